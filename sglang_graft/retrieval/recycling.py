"""Token recycling: the target's own top-k successors of every token, reused as a draft.

Every verify round computes the target's distribution at every tree position, accepted or
not; the top-k of each is a strong guess for what follows that token next time it
appears, in any request. The table ``[vocab, k]`` (int32, on the device) keeps the latest
top-k per token and is never reset, so it warms up across requests. For Qwen3 (151,936
tokens, k = 8) it takes 4.9 MB.

Proposing is a best-first expansion from the root through the table, scored in the common
currency: a node's score is the product of the calibrated step rates of the ranks along
its path (rank 0 = the target's top-1), each rate rounded to ~3% (``rounded_rates``).
Since the score depends only on the ranks, the best-first order over rank paths and the
scores are computed once on the host (a lazy priority queue, ``rank_template``) and
recomputed only when a calibrated rate leaves the band around the rounded rate it was
built for (``_KEEP_STEPS``); each round then gathers the actual tokens level by level on
the device, for the whole batch at once.
Successors the table does not know (never-seen tokens) drop out with their subtrees, and
the final best-``budget`` selection takes the next-best existing nodes instead: the shape
follows the table and the rates, not a fixed template.

On the CPU the table's memory is a host ``array`` too, and small batches use host loops
over it (``best_existing``, ``write_rows``): the same nodes without a tensor op per level.

Unknown successors are -1, and the table has two extra rows: the last one (which index -1
reaches) is all -1, so an unknown token's "successors" are unknown too and missing nodes
propagate to their descendants with no masking; row ``vocab`` absorbs the writes of batch
duplicates that lose the last-write-wins rule and is never read.
"""

from __future__ import annotations

import functools
import heapq
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sglang_graft.candidates import Candidates, Source
from sglang_graft.host_arrays import shared_array
from sglang_graft.retrieval.selection import PackedCandidates, budget_list, select_top
from sglang_graft.retrieval.tokens import check_id_range, check_integer_ids


@dataclass(frozen=True)
class RankTemplate:
    """The best rank paths below a root, laid out level by level (parents before children).

    Attributes:
        parents: per node, the index of its parent node, -1 for children of the root.
        ranks: per node, the rank of its token in its parent's successor row.
        levels: per depth, ``(parent position in the previous level, rank)`` of its nodes.
        scores: per node, its path score: the product of its ranks' step rates.
    """

    parents: list[int]
    ranks: list[int]
    levels: list[tuple[list[int], list[int]]]
    scores: list[float]


def rank_template(rank_rates: Sequence[float], max_nodes: int, max_depth: int) -> RankTemplate:
    """Best-first enumeration of the ``max_nodes`` highest-scoring rank paths (depth <= ``max_depth``).

    A node's children are visited in decreasing rate, so each popped node only needs to
    push two successors: its own best child and its next sibling. That keeps the queue
    at O(max_nodes) and yields nodes in non-increasing score, ties in push order.
    """
    k = len(rank_rates)
    by_rate = sorted(range(k), key=lambda r: (-rank_rates[r], r))
    # Queue entries: (-score, push order, parent node, sibling index in by_rate, depth).
    queue = [(-rank_rates[by_rate[0]], 0, -1, 0, 1)]
    pushes = 1
    parents: list[int] = []
    ranks: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    while queue and len(parents) < max_nodes:
        neg, _, parent, sibling, depth = heapq.heappop(queue)
        node = len(parents)
        parents.append(parent)
        ranks.append(by_rate[sibling])
        depths.append(depth)
        scores.append(-neg)
        above = 1.0 if parent < 0 else scores[parent]
        if sibling + 1 < k:
            heapq.heappush(queue, (-above * rank_rates[by_rate[sibling + 1]], pushes, parent, sibling + 1, depth))
            pushes += 1
        if depth < max_depth:
            heapq.heappush(queue, (neg * rank_rates[by_rate[0]], pushes, node, 0, depth + 1))
            pushes += 1

    # Re-lay out level by level (stable within a level) so the device can gather a level at once.
    order = sorted(range(len(parents)), key=lambda i: (depths[i], i))
    new_index = {old: new for new, old in enumerate(order)}
    level_pos: dict[int, int] = {}
    levels: list[tuple[list[int], list[int]]] = []
    for old in order:
        d = depths[old]
        if d > len(levels):
            levels.append(([], []))
        level_pos[old] = len(levels[d - 1][0])
        levels[d - 1][0].append(0 if parents[old] < 0 else level_pos[parents[old]])
        levels[d - 1][1].append(ranks[old])
    return RankTemplate(
        parents=[new_index[parents[i]] if parents[i] >= 0 else -1 for i in order],
        ranks=[ranks[i] for i in order],
        levels=levels,
        scores=[scores[i] for i in order],
    )


#: Rates are rounded to this many steps per unit of log: 1/32, about 3%.
_STEPS_PER_LOG_UNIT = 32

#: A built template is kept while every calibrated rate stays within this many steps of
#: the rounded rate it was built for (so its scores are within about 3% of the calibrated
#: ones), and rebuilt at the newly rounded rates when one leaves. A band of half a step
#: (plain rounding) rebuilt it whenever a rate sat at a step edge: the rare-rank rates move
#: a step with single acceptances, so 10-14% of rounds paid a rebuild (~100 us on a cold
#: CPU cache, more than the rest of the round); one step cuts that several times over.
_KEEP_STEPS = 1.0


def _rate_steps(rank_rates: Sequence[float]) -> tuple[int, ...]:
    if min(rank_rates) < 0.0 or max(rank_rates) > 1.0:
        raise ValueError(f"rank_rates must be probabilities in [0, 1], got {list(rank_rates)}")
    return tuple(round(math.log(max(r, 1e-6)) * _STEPS_PER_LOG_UNIT) for r in rank_rates)


def _rates_of_steps(steps: Sequence[int]) -> list[float]:
    return [math.exp(q / _STEPS_PER_LOG_UNIT) for q in steps]


def rounded_rates(rank_rates: Sequence[float]) -> list[float]:
    """The step rates recycled scores are built from: each rounded to the nearest
    1/32 step of its log (about 3%; at least 1e-6).

    Calibrated rates are estimates noisier than that, and with rounded rates the best-first
    template (its order and its scores) is a function of the rounded rates alone. A
    ``RecyclingTable`` builds it at the rounded rates and keeps it while the calibrated
    rates stay within ``_KEEP_STEPS`` of them, so it is rebuilt every few dozen rounds,
    not every round.
    """
    return _rates_of_steps(_rate_steps(rank_rates))


class RecycledNodes(NamedTuple):
    """The template's nodes below each root of a batch, best first (parents before children)."""

    tokens: torch.Tensor  # [bs, size] int32 on the device; -1 where the table knows no successor
    parents: list[int]  # per node: -1 for children of the root, else an earlier node
    ranks: list[int]  # per node: its rank, which is its calibration bin
    scores: list[float]  # per node: its path score


class RecycledPicks(NamedTuple):
    """``RecyclingTable.best_existing``: the best known template nodes below each root."""

    parents: list[int]  # per template node (column): its parent's column, -1 for the root
    ranks: list[int]  # per template node: its rank, which is its calibration bin
    scores: list[float]  # per template node: its path score, rounded to float32
    nodes: list[list[int]]  # per root: the picked template nodes, in selection order
    tokens: list[list[int]]  # per root: those nodes' tokens


class _BuiltTemplate:
    """A ``RankTemplate`` with what every round reuses until a rate leaves its band: the
    host scores and walk in selection order, and (built on first use: host loops never
    need them) the device index tensors, packed fields and scores."""

    def __init__(self, t: RankTemplate, key: tuple[int, ...], device: torch.device) -> None:
        self.template = t
        self.key = key
        self.size = len(t.parents)
        self.device = device
        # Rates strictly between these bounds (``_KEEP_STEPS`` either side of ``key``,
        # narrowed by a margin far above rounding error) keep the template; comparing with
        # them needs no logarithms.
        margin = 1e-6
        band = _KEEP_STEPS - margin
        self.low = [math.exp((q - band) / _STEPS_PER_LOG_UNIT) for q in key]
        self.high = [math.exp((q + band) / _STEPS_PER_LOG_UNIT) for q in key]  # above 1 for q = 0: rates are <= 1
        # Host loops: the scores as float32 values and the nodes in select_top's order.
        self.scores32: list[float] = array("f", t.scores).tolist()
        order = sorted(range(self.size), key=self.scores32.__getitem__, reverse=True)
        self.walk = [(i, t.parents[i], t.ranks[i]) for i in order]  # (node, parent, rank)

    @functools.cached_property
    def levels(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per depth, the (parent position, rank) index tensors ``expand_tokens`` gathers with."""
        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return [(index(pos), index(r)) for pos, r in self.template.levels]

    @functools.cached_property
    def fields(self) -> torch.Tensor:
        """The packed fields but the tokens row: ``[parents, sources, bins]``, ``[3, 1, size]``."""
        t = self.template
        rows = [t.parents, [int(Source.RECYCLING)] * self.size, t.ranks]
        return torch.tensor(rows, dtype=torch.int64, device=self.device).view(3, 1, self.size)

    @functools.cached_property
    def scores(self) -> torch.Tensor:
        """``[1, size]`` float32 path scores."""
        return torch.tensor([self.template.scores], dtype=torch.float32, device=self.device)


class RecyclingTable:
    """Device-resident ``[vocab, k]`` table of the target's top-k successors.

    Args:
        vocab_size: number of token ids.
        k: successors kept per token (rank buckets of the calibration).
        max_nodes: rank paths explored per proposal (the most a proposal can hold).
        max_depth: deepest proposed node.
        device: where the table lives (the target model's device).
    """

    def __init__(
        self,
        vocab_size: int,
        k: int = 8,
        *,
        max_nodes: int = 64,
        max_depth: int = 6,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 1 <= vocab_size < 2**31 - 2:
            raise ValueError(f"vocab_size must be in [1, {2**31 - 2}), got {vocab_size}")
        if k < 1:
            raise ValueError(f"recycling k must be >= 1, got {k}")
        if max_nodes < 1 or max_depth < 1:
            raise ValueError(f"max_nodes and max_depth must be >= 1, got {max_nodes} and {max_depth}")
        self.vocab_size = vocab_size
        self.k = k
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.device = torch.device(device)
        self._trash_row = vocab_size
        # On the CPU the table also lives in a host array, for the host-loop paths.
        self._host: array | None = None
        if self.device.type == "cpu":
            self._host, flat = shared_array("i", (vocab_size + 2) * k, -1)
            self._table = flat.view(vocab_size + 2, k)
        else:
            self._table = torch.full((vocab_size + 2, k), -1, dtype=torch.int32, device=self.device)
        self._template: _BuiltTemplate | None = None

    def memory_bytes(self) -> int:
        return self._table.numel() * self._table.element_size()

    def successors(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` int64 successors of ``tokens`` by rank, -1 where unknown."""
        return self._table[tokens.long()].long()

    def update(
        self,
        tokens: torch.Tensor,
        topk_ids: torch.Tensor | None = None,
        *,
        logits: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Record the target's top-k successors at every position of a verified batch.

        Args:
            tokens: ``[bs, n]`` the tree tokens the target saw.
            topk_ids: ``[bs, n, k']`` the target's top-k' ids at each position, best
                first; ranks beyond ``k`` are dropped, missing ones stay unknown.
            logits: ``[bs, n, vocab]`` instead of ``topk_ids`` (its top-k is taken).
            valid: ``[bs, n]`` bool, positions to record (default: all).

        A token that occurs several times in the batch keeps the last occurrence in
        row-major order: the later column wins within a request, the later request wins
        across requests. The rule is applied explicitly, not left to the scatter.
        """
        ids = self.target_ids(tokens, topk_ids, logits=logits)
        if valid is not None and valid.shape != tokens.shape:
            raise ValueError(f"valid must match tokens {tuple(tokens.shape)}, got {tuple(valid.shape)}")
        if tokens.numel() == 0:
            return
        self._check_ids("recycling tokens", tokens if valid is None else torch.where(valid, tokens, 0))
        self._check_ids("recycling topk_ids", ids)
        self.write(tokens, ids, valid)

    def target_ids(
        self, tokens: torch.Tensor, topk_ids: torch.Tensor | None, *, logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``[bs, n, k']`` top-k ids ``update`` records, shape-checked against ``tokens``
        (taken from ``logits`` when those are given instead); their values are not checked."""
        if tokens.dim() != 2:
            raise ValueError(f"recycling tokens must be [bs, n], got shape {tuple(tokens.shape)}")
        if topk_ids is not None and logits is None:
            ids = topk_ids
        elif logits is not None and topk_ids is None:
            if logits.dim() != 3 or logits.shape[:2] != tokens.shape:
                raise ValueError(
                    f"logits must be [bs, n, vocab] matching tokens {tuple(tokens.shape)}, got {tuple(logits.shape)}"
                )
            ids = logits.topk(min(self.k, logits.shape[-1]), dim=-1).indices
        else:
            raise ValueError("recycling update needs exactly one of topk_ids and logits")
        if ids.dim() != 3 or ids.shape[:2] != tokens.shape:
            raise ValueError(
                f"topk_ids must be [bs, n, k] matching tokens {tuple(tokens.shape)}, got {tuple(ids.shape)}"
            )
        check_integer_ids("recycling topk_ids", ids)
        return ids

    def write(self, tokens: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """``update`` without its checks, for callers that range-checked ``tokens`` and ``ids``
        already (``Retriever.observe`` checks every tree tensor with one host sync)."""
        rows = ids.reshape(-1, ids.shape[-1])
        if rows.shape[1] > self.k:
            rows = rows[:, : self.k]
        elif rows.shape[1] < self.k:
            rows = torch.nn.functional.pad(rows, (0, self.k - rows.shape[1]), value=-1)
        flat = tokens.reshape(-1)
        if valid is not None:
            flat = torch.where(valid.reshape(-1), flat, self._trash_row)
        # Last write wins: after a stable sort, the last of each run of equal tokens is the
        # latest occurrence; every other one is sent to the trash row. (Token ids are >= 0,
        # so the -1 padding after the last one never equals it.)
        ordered, perm = torch.sort(flat, stable=True)
        is_last = ordered != torch.nn.functional.pad(ordered[1:], (0, 1), value=-1)
        self._table[torch.where(is_last, ordered, self._trash_row)] = rows[perm].to(torch.int32)

    def write_rows(self, tokens: list[int], rows: array, width: int) -> None:
        """``write`` from the host, for CPU tables: ``rows`` is a flat ``array('i')`` of
        ``width`` ids per token (best first, cut or padded with -1 to ``k``), and row ``i``
        becomes the successors of ``tokens[i]``. Later positions overwrite earlier ones,
        which is ``write``'s last-write-wins rule. Ids must be range-checked already."""
        table, k = self._host_table(), self.k
        if width >= k:
            for i, t in enumerate(tokens):
                table[t * k : t * k + k] = rows[i * width : i * width + k]
        else:
            pad = array("i", [-1]) * (k - width)
            for i, t in enumerate(tokens):
                table[t * k : t * k + k] = rows[i * width : i * width + width] + pad

    def best_existing(self, roots: list[int], rank_rates: Sequence[float], limit: int) -> RecycledPicks:
        """Per root, the ``limit`` best template nodes whose token the table knows, found by
        host loops (CPU tables): what ``expand_tokens`` followed by a best-``limit``
        selection keeps, without gathering every template node.

        Nodes are walked in selection order (float32 score descending, then column), in
        which a parent always precedes its children (a child never outscores its parent,
        and its column is larger), so each token is read from its parent's. An unknown
        node is skipped, and so are its descendants (on the device they read the all -1
        last row).
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1 node per root, got {limit}")
        built = self._built_template(rank_rates)
        table, k = self._host_table(), self.k
        nodes, tokens = [], []
        for root in roots:
            known = [-1] * built.size
            row_nodes: list[int] = []
            for i, p, rank in built.walk:
                if p < 0:
                    token = table[root * k + rank]
                else:
                    parent = known[p]
                    if parent < 0:
                        continue
                    token = table[parent * k + rank]
                if token >= 0:
                    known[i] = token
                    row_nodes.append(i)
                    if len(row_nodes) == limit:
                        break
            nodes.append(row_nodes)
            tokens.append([known[i] for i in row_nodes])
        return RecycledPicks(built.template.parents, built.template.ranks, built.scores32, nodes, tokens)

    def _host_table(self) -> array:
        if self._host is None:
            raise RuntimeError(f"the recycling table is on {self.device}; host-loop access needs a CPU table")
        return self._host

    def expand(self, roots: torch.Tensor, rank_rates: Sequence[float]) -> PackedCandidates:
        """Every node of the current best-first template below each root (``[bs]`` int64).

        Nodes whose successor is unknown get token -1 (so do their descendants); budgets
        are applied by ``propose`` or by the caller's merged selection.
        """
        return self.pack(self.expand_tokens(roots, rank_rates))

    def pack(self, nodes: RecycledNodes) -> PackedCandidates:
        """The packed form of the latest ``expand_tokens`` result."""
        bs, size = nodes.tokens.shape
        assert self._template is not None
        fields = torch.cat([nodes.tokens.unsqueeze(0), self._template.fields.expand(3, bs, size)])
        return PackedCandidates(fields, self._template.scores.expand(bs, size))

    def expand_tokens(self, roots: torch.Tensor, rank_rates: Sequence[float]) -> RecycledNodes:
        """``expand`` with only the tokens on the device: the rest of each node is the same for
        every root, so a caller that packs other proposals on the host can add it there."""
        t = self._built_template(rank_rates)
        bs = roots.shape[0]
        (_, first_ranks), *deeper = t.levels
        # Every first-level node hangs off the root: one broadcast lookup, no parent gather.
        level = self._table[roots.view(bs, 1), first_ranks]
        levels = [level]
        for parent_pos, ranks in deeper:
            level = self._table[level.index_select(1, parent_pos), ranks]
            levels.append(level)
        template = t.template
        return RecycledNodes(torch.cat(levels, dim=1), template.parents, template.ranks, template.scores)

    def propose(self, roots: torch.Tensor, rank_rates: Sequence[float], budget: int | torch.Tensor) -> Candidates:
        """The ``budget`` best recycled nodes below each root (``[bs]`` tokens), best first."""
        self._check_ids("recycling roots", roots)
        width = max(budget_list(budget, roots.shape[0]), default=0)
        return select_top(self.expand(roots.long(), rank_rates), budget, width)

    def _built_template(self, rank_rates: Sequence[float]) -> _BuiltTemplate:
        """The template built at the rounded rates of the last rebuild, rebuilt at these
        rates rounded (``rounded_rates``) when one of them has left its band
        (``_KEEP_STEPS`` either side of its rounded rate)."""
        if len(rank_rates) != self.k:
            raise ValueError(f"rank_rates must have k={self.k} entries, got {len(rank_rates)}")
        built = self._template
        if built is not None and all(lo < r < hi for lo, r, hi in zip(built.low, rank_rates, built.high)):
            return built  # every rate is safely inside its band: same template, no logs
        key = _rate_steps(rank_rates)
        if built is None or built.key != key:
            t = rank_template(_rates_of_steps(key), self.max_nodes, self.max_depth)
            self._template = built = _BuiltTemplate(t, key, self.device)
        return built

    def _check_ids(self, what: str, ids: torch.Tensor) -> None:
        check_integer_ids(what, ids)
        if ids.numel():
            check_id_range(what, *(int(v) for v in torch.aminmax(ids)), self.vocab_size)
