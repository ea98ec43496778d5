"""Merge retrieval proposals and keep each request's best ``budget``, compacted, best first.

Every retrieval source scores in the same currency, so merging them is one selection by
score. A child never outscores its parent and ties keep column order (a parent's column is
always lower), so the kept set is ancestor-closed and the output order (score descending)
is topological: parent columns can simply be renumbered.

Proposals travel between the sources and this selection as ``PackedCandidates``: the four
integer fields stacked in one tensor and padding marked by token -1. On small batches
the cost of a round is the number of tensor operations, not their size, and stacking
lets one gather move every field at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_graft.candidates import Candidates
from sglang_graft.tree import arange_cached

TOKENS, PARENTS, SOURCES, BINS = range(4)


class PackedCandidates(NamedTuple):
    """Candidates as ``fields`` ``[4, bs, m]`` int64 (tokens, parents, sources, bins) and
    ``scores`` ``[bs, m]`` float32; a token of -1 marks a padding column."""

    fields: torch.Tensor
    scores: torch.Tensor


def select_top(packed: PackedCandidates, budget: int | torch.Tensor, width: int) -> Candidates:
    """The ``budget`` best nodes of each request, in ``width`` columns, best first.

    Args:
        packed: proposals whose scores never increase from parent to child.
        budget: an int for every request, or a ``[bs]`` integer tensor.
        width: output columns; at least the largest budget for nothing to be cut.
            Columns past a request's kept nodes are padding (``valid`` False, token -1).
    """
    fields, scores = packed
    _, bs, m = fields.shape
    device = fields.device
    width = min(width, m)
    if width <= 0:
        return Candidates.empty(bs, device)
    order = torch.sort(torch.where(fields[TOKENS] >= 0, scores, -1.0), dim=1, descending=True, stable=True).indices
    # Output column of every input column, behind a sentinel column that maps the root's
    # parent -1 to -1, so remapping the parents is one gather.
    rank_or_root = order.new_full((bs, m + 1), -1)
    rank_or_root[:, 1:].scatter_(1, order, arange_cached(m, device).expand(bs, m))
    top = order[:, :width]
    picked = fields.gather(2, top.unsqueeze(0).expand(4, bs, width))
    tokens = picked[TOKENS]
    keep = tokens >= 0
    if isinstance(budget, torch.Tensor) or budget < width:
        limit = budget.view(bs, 1) if isinstance(budget, torch.Tensor) else budget
        keep &= arange_cached(width, device) < limit
        tokens = torch.where(keep, tokens, -1)
    return Candidates(
        tokens=tokens,
        parents=rank_or_root.gather(1, picked[PARENTS] + 1),
        scores=scores.gather(1, top),
        sources=picked[SOURCES],
        valid=keep,
        bins=picked[BINS],
    )


def budget_list(budget: int | torch.Tensor, bs: int) -> list[int]:
    """Per-request budgets as ints, rejecting anything but non-negative integers."""
    if isinstance(budget, torch.Tensor):
        if budget.shape != (bs,) or budget.is_floating_point() or budget.dtype == torch.bool:
            raise ValueError(f"budget tensor must be [bs={bs}] integers, got {budget.dtype} {tuple(budget.shape)}")
        values = budget.tolist()
    elif isinstance(budget, int) and not isinstance(budget, bool):
        values = [budget] * bs
    else:
        raise ValueError(f"budget must be an int or a [bs] integer tensor, got {type(budget).__name__}")
    low = min(values, default=0)
    if low < 0:
        raise ValueError(f"budget must be >= 0 nodes per request, got {low}")
    return values
