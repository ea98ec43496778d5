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

from array import array
from typing import NamedTuple

import torch

from sglang_graft.candidates import Candidates, Source
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


class HostColumns(NamedTuple):
    """One request's proposals on the host, for ``select_top_host``.

    Every node is a column of the request's packed block (``columns``), listed in
    ``select_top``'s order within each source (score descending, then column ascending)
    and the sources concatenated in column order; padding and unknown nodes are left out.
    ``parents`` are columns too (-1: the root); ``scores`` are float32 values, as the
    packed tensor would hold them.
    """

    columns: list[int]
    tokens: list[int]
    parents: list[int]
    sources: list[int]
    bins: list[int]
    scores: list[float]


def select_top_host(rows: list[HostColumns], budgets: list[int], width: int, counts: array) -> Candidates:
    """``select_top`` as host loops (CPU), for small batches where a dozen tensor ops cost
    more than sorting a few dozen floats: the same kept nodes, in the same columns.

    Concatenated sources already in order, ``sorted(reverse=True)`` (stable) reproduces the
    tensor sort's (score descending, column ascending) order. Padding columns are
    canonical (token and parent -1, source FILLER, bin 0, score 0); the tensor version
    leaves whatever it gathered there, and both mark them ``valid`` False. Each kept node
    also adds one to ``counts[source]`` (the proposal statistics), while it is on the host.
    """
    bs = len(rows)
    if width <= 0:
        return Candidates.empty(bs)
    tokens, parents, sources, bins = array("q"), array("q"), array("q"), array("q")
    scores = array("f")
    valid = bytearray()
    for row, budget in zip(rows, budgets):
        order = sorted(range(len(row.scores)), key=row.scores.__getitem__, reverse=True)[: min(budget, width)]
        position = {row.columns[i]: j for j, i in enumerate(order)}
        for i in order:
            tokens.append(row.tokens[i])
            parent = row.parents[i]
            parents.append(position[parent] if parent >= 0 else -1)
            sources.append(row.sources[i])
            counts[row.sources[i]] += 1
            bins.append(row.bins[i])
            scores.append(row.scores[i])
        pad = width - len(order)
        tokens.extend([-1] * pad)
        parents.extend([-1] * pad)
        sources.extend([int(Source.FILLER)] * pad)
        bins.extend([0] * pad)
        scores.extend([0.0] * pad)
        valid += b"\x01" * len(order) + b"\x00" * pad

    # The four integer fields share one buffer, split by ``unbind`` into views; scores and
    # ``valid`` get their own (measured: each tensor built over a host buffer costs a few
    # microseconds here, about as much as the rest of the selection).
    fields = torch.frombuffer(tokens + parents + sources + bins, dtype=torch.int64).view(4, bs, width).unbind()
    return Candidates(
        tokens=fields[0],
        parents=fields[1],
        scores=torch.frombuffer(scores, dtype=torch.float32).view(bs, width),
        sources=fields[2],
        valid=torch.frombuffer(valid, dtype=torch.bool).view(bs, width),
        bins=fields[3],
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
