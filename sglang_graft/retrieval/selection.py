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

TOKENS, PARENTS, SOURCES, BINS = range(4)


class PackedCandidates(NamedTuple):
    """Candidates as ``fields`` ``[4, bs, m]`` int64 (tokens, parents, sources, bins) and
    ``scores`` ``[bs, m]`` float32; a token of -1 marks a padding column."""

    fields: torch.Tensor
    scores: torch.Tensor


def concat_packed(parts: list[PackedCandidates]) -> PackedCandidates:
    """Columns of ``parts`` side by side; each part's parent columns must already count the
    columns of the parts before it (producers take a ``column_offset`` for that)."""
    if len(parts) == 1:
        return parts[0]
    return PackedCandidates(torch.cat([p.fields for p in parts], dim=2), torch.cat([p.scores for p in parts], dim=1))


def select_top(packed: PackedCandidates, budget: int | torch.Tensor, width: int) -> Candidates:
    """The ``budget`` best nodes of each request, in ``width`` columns, best first.

    Args:
        packed: proposals whose scores never increase from parent to child; its parents
            row is overwritten (callers hand over freshly built tensors).
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
    valid = fields[TOKENS] >= 0
    order = torch.sort(torch.where(valid, scores, -1.0), dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(m, device=device).expand(bs, m))
    # Parents as output columns (in place: ``packed`` is consumed); a sentinel column in
    # front maps the root's -1 to -1.
    rank_or_root = torch.cat([rank.new_full((bs, 1), -1), rank], dim=1)
    fields[PARENTS] = rank_or_root.gather(1, fields[PARENTS] + 1)
    order = order[:, :width]
    picked = fields.gather(2, order.unsqueeze(0).expand(4, bs, width))
    limit = budget.view(bs, 1) if isinstance(budget, torch.Tensor) else budget
    keep = (picked[TOKENS] >= 0) & (torch.arange(width, device=device) < limit)
    return Candidates(
        tokens=torch.where(keep, picked[TOKENS], -1),
        parents=picked[PARENTS],
        scores=scores.gather(1, order),
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
