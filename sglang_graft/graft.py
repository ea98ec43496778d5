"""Grafting: merge drafted and retrieved proposals into one verify tree of exactly ``n`` nodes.

All proposals hang off the same root and carry the same currency, the estimated
probability that the target accepts the whole path down to them. Grafting therefore is a
single best-first selection over the union:

1. **Summarise paths** with the ancestor matrix of the candidate forest (transitive closure
   by ``ceil(log2 m)`` batched matmuls): each node's depth, whether every node on its path
   is valid, the minimum score on the path (so scores never increase from parent to
   child), and a 64-bit hash of its token path (sum over the path of token x R^depth).
2. **Merge duplicates**: nodes with the same path hash are one node. The lowest column
   (drafts come first) is kept, with the best score of the group; the others' children
   re-attach to it. A retrieved chain that repeats a draft path thus continues that path
   instead of spending slots on a copy. A hash collision (odds about m^2 / 2^64) could
   only merge two different paths: that changes what is proposed, never what
   verification accepts, so it cannot break losslessness.
3. **Select** the best ``n - 1`` by (score desc, depth asc, column asc). Because a parent
   scores at least as high as its child and is shallower, the chosen set is always
   ancestor-closed; the key is unique, so every process builds the same tree.
4. **Fill**: if fewer than ``n - 1`` real nodes exist, a chain of filler nodes (the root
   token repeated) takes the remaining slots, so shapes stay static for CUDA graphs.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sglang_graft.candidates import Candidates, Source, concat_candidates
from sglang_graft.tree import TokenTree, ancestor_mask, arange_cached

_HASH_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constant (golden ratio), as signed int64
_HASH_BASE = 0x100000001B3  # odd multiplier for depth powers; products wrap modulo 2**64
_HASH_BASE_INV = pow(_HASH_BASE, -1, 1 << 64)  # exists because the base is odd
_INVALID = 1 << 32  # counts invalid nodes on a path in the high half of the depth counter
_DEPTH_BITS = _INVALID - 1
_DEAD_KEY = torch.iinfo(torch.int64).max  # sorts after every live key


class PathSummary(NamedTuple):
    """Per-candidate facts about the path from the root down to it."""

    ancestors: torch.Tensor  # [bs, m, m] bool, ancestor-or-self (the root excluded)
    depth: torch.Tensor  # [bs, m] int64, 1 for children of the root
    valid: torch.Tensor  # [bs, m] bool, every node on the path is valid
    min_score: torch.Tensor  # [bs, m] float32, smallest score on the path
    path_hash: torch.Tensor  # [bs, m] int64 hash of the root-to-node token path


class PathFacts(NamedTuple):
    """``PathSummary`` without the ``[bs, m, m]`` ancestor matrix, which grafting never needs."""

    depth: torch.Tensor
    valid: torch.Tensor
    min_score: torch.Tensor
    path_hash: torch.Tensor


def summarise_paths(c: Candidates) -> PathSummary:
    """Path facts for every candidate, with the forest's ancestor matrix."""
    bs, m = c.tokens.shape
    if m == 0:
        z = torch.zeros(bs, 0, dtype=torch.int64, device=c.tokens.device)
        return PathSummary(z.view(bs, 0, 0).bool(), z, z.bool(), z.float(), z)
    return PathSummary(ancestor_mask(c.parents), *path_facts(c))


def _signed64(x: int) -> int:
    x %= 1 << 64
    return x - (1 << 64) if x >= 1 << 63 else x


@functools.lru_cache(maxsize=64)
def _jump_weights(k: int, device: torch.device) -> torch.Tensor:
    """``[1, 2, 1]`` int64 weights of the ``k``-th doubling step in ``path_facts``: counters add
    as they are; a hash accumulated ``2**k`` levels further up is scaled by ``BASE**-(2**k)``."""
    return torch.tensor([[[1], [_signed64(pow(_HASH_BASE_INV, 1 << k, 1 << 64))]]], device=device)


@functools.lru_cache(maxsize=64)
def _hash_powers(size: int, device: torch.device) -> torch.Tensor:
    """``BASE ** (d + 1)`` modulo ``2**64`` for ``d < size``."""
    return torch.full((size,), _HASH_BASE, dtype=torch.int64, device=device).cumprod(dim=0)


def path_facts(c: Candidates) -> PathFacts:
    """Depth, validity, minimum score and token-path hash of every candidate's root path.

    Pointer doubling over the parent links (``ceil(log2 m)`` rounds of a few ``[bs, m]``
    gathers, no ``m x m`` matrix): each node accumulates the path segment of ``2**k`` nodes
    above it, then jumps ``2**k`` levels. The hash is ``sum over the path of
    (token + 1) * MIX * BASE**(depth + 1)`` modulo ``2**64``; since the depth is known only
    at the end, the rounds accumulate ``BASE**-(distance)`` and multiply by ``BASE**(depth + 1)``
    once (the base is odd, hence invertible modulo ``2**64``), which yields the same integer.
    """
    bs, m = c.tokens.shape
    ptr = F.pad(c.parents.remainder(m + 1), (0, 1), value=m)  # -1 -> sentinel m, which points to itself
    counter = torch.where(c.valid, 1, _INVALID + 1)  # depth in the low half, invalid nodes in the high
    sums = F.pad(torch.stack([counter, (c.tokens + 1) * _HASH_MIX], dim=1), (0, 1))
    mins = F.pad(c.scores.float(), (0, 1), value=2.0)
    for k in range(math.ceil(math.log2(m)) if m > 1 else 0):
        sums = torch.addcmul(sums, sums.gather(2, ptr.unsqueeze(1).expand(bs, 2, m + 1)), _jump_weights(k, ptr.device))
        mins = torch.minimum(mins, mins.gather(1, ptr))
        ptr = ptr.gather(1, ptr)
    counter, acc = sums[:, 0, :m], sums[:, 1, :m]
    depth = counter & _DEPTH_BITS
    path_hash = acc * _hash_powers(m + 1, ptr.device)[depth.clamp(max=m)]
    return PathFacts(depth, counter < _INVALID, mins[:, :m], path_hash)


class GraftResult(NamedTuple):
    tree: TokenTree
    num_merged: torch.Tensor  # [bs] int64: proposals that duplicated another's path


def graft(root_tokens: torch.Tensor, proposals: list[Candidates], num_nodes: int) -> GraftResult:
    """Build the verify tree from the root and every proposer's candidates.

    Args:
        root_tokens: ``[bs]`` last verified token of each request.
        proposals: candidate sets, highest priority first (drafts before retrieval):
            on a duplicate path the earliest proposer keeps the node and its source.
        num_nodes: ``n``, the verify budget including the root (>= 2).
    """
    if num_nodes < 2:
        raise ValueError(f"num_nodes (verify budget n) must be >= 2, got {num_nodes}")
    if not proposals:
        raise ValueError("graft needs at least one Candidates (use Candidates.empty for none)")
    bs = root_tokens.shape[0]
    for c in proposals:
        if c.batch_size != bs:
            raise ValueError(f"proposals have batch size {c.batch_size}, root_tokens has {bs}")
    cands = concat_candidates(list(proposals))
    m = cands.width
    if m == 0:  # every source dry: the whole tree is filler
        fillers = torch.ones(bs, num_nodes - 1, dtype=torch.int64, device=root_tokens.device)  # column m + 1
        zero = torch.zeros(bs, dtype=torch.int64, device=root_tokens.device)
        none = torch.full((bs, 1), -1, dtype=torch.int64, device=root_tokens.device)  # only the root reads it
        return GraftResult(_assemble_tree(root_tokens, cands, fillers, zero, none, cands.parents, cands.scores), zero)
    facts = path_facts(cands)
    canonical, merged_score = _merge_duplicates(facts)
    is_canonical = facts.valid & (canonical == arange_cached(m, root_tokens.device))
    num_merged = (facts.valid ^ is_canonical).sum(dim=1)
    chosen, num_real, rank = _select_best(merged_score, facts.depth, is_canonical, num_nodes - 1)
    # Tree parent of a chosen node: its original parent's canonical column (+2, see
    # _assemble_tree), or 1 for a child of the root.
    parent_key = F.pad(canonical + 2, (1, 0), value=1).gather(1, cands.parents + 1)
    scores = merged_score.clamp(min=0.0)
    tree = _assemble_tree(root_tokens, cands, chosen, num_real, rank, parent_key, scores)
    return GraftResult(tree, num_merged)


def trim(tree: TokenTree, num_nodes: int) -> TokenTree:
    """The best ``num_nodes`` nodes of ``tree`` (the root included) as a tree of their own.

    The same selection as ``graft``'s (score desc, depth asc, then tree position, which
    follows the original columns), so the kept nodes are ancestor-closed and every process
    keeps the same ones; filler nodes never count.
    """
    if num_nodes >= tree.num_nodes:
        return tree
    return graft(tree.tokens[:, 0], [_tree_nodes(tree)], num_nodes).tree


def graft_below(tree: TokenTree, below: Candidates, num_nodes: int) -> GraftResult:
    """Re-select ``tree`` with ``below``'s nodes hanging under its nodes (the context
    continuations of draft paths, ``Retriever.propose_below``).

    ``below.parents`` are tree positions: ``p < tree.num_nodes`` is that node of ``tree``
    (``p >= 1``: the root's children are retrieval's to propose), ``p = tree.num_nodes + j``
    is column ``j`` of ``below``. The same selection as ``graft``'s then keeps the best
    ``num_nodes`` of both, merging a continuation that repeats a tree path into it.
    """
    if below.batch_size != tree.batch_size:
        raise ValueError(f"below has batch size {below.batch_size}, the tree {tree.batch_size}")
    nodes = _tree_nodes(tree)
    # Tree position p is column p - 1 of the tree's nodes, and position n + j is column
    # n - 1 + j of the two side by side: every parent is its position minus one.
    both = Candidates(
        tokens=torch.cat([nodes.tokens, below.tokens], dim=1),
        parents=torch.cat([nodes.parents, below.parents - 1], dim=1),
        scores=torch.cat([nodes.scores, below.scores], dim=1),
        sources=torch.cat([nodes.sources, below.sources], dim=1),
        valid=torch.cat([nodes.valid, below.valid], dim=1),
        bins=torch.cat([nodes.bins, below.bins], dim=1),
    )
    return graft(tree.tokens[:, 0], [both], num_nodes)


def _tree_nodes(tree: TokenTree) -> Candidates:
    """A tree's nodes below the root as candidates (tree position ``p`` is column ``p - 1``)."""
    body = slice(1, None)
    return Candidates(
        tokens=tree.tokens[:, body],
        parents=tree.parents[:, body] - 1,  # tree position 0 (the root) becomes -1
        scores=tree.scores[:, body],
        sources=tree.sources[:, body],
        valid=tree.sources[:, body] != int(Source.FILLER),
        bins=tree.bins[:, body],
    )


def _merge_duplicates(facts: PathFacts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(canonical, merged_score)`` ``[bs, m]``: for each live column, the lowest live column
    with the same path hash, and the best ``min_score`` among them (dead columns: meaningless).

    Sorting the hashes numbers the groups of equal paths; two scatter-reductions then give
    each group's lowest live column and best score in ``O(m log m)``.
    """
    bs, m = facts.path_hash.shape
    device = facts.path_hash.device
    alive = facts.valid
    sorted_hash, order = facts.path_hash.sort(dim=1)
    new_group = F.pad(sorted_hash[:, 1:] != sorted_hash[:, :-1], (1, 0))
    group = torch.empty_like(order).scatter_(1, order, new_group.cumsum(dim=1))
    cols = arange_cached(m, device).expand(bs, m)
    lowest = torch.full_like(order, m).scatter_reduce_(1, group, torch.where(alive, cols, m), "amin")
    best = torch.full_like(facts.min_score, -1.0).scatter_reduce_(
        1, group, torch.where(alive, facts.min_score, -1.0), "amax"
    )
    return lowest.gather(1, group), best.gather(1, group)


def _select_best(
    merged_score: torch.Tensor, depth: torch.Tensor, is_canonical: torch.Tensor, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(chosen [bs, slots], num_real [bs], rank [bs, m + 2])``: the columns of the best
    ``num_real`` live canonical nodes in ascending order, then ``m + 1`` (a filler slot)
    for the rest; and, at index ``c + 2``, the tree position of chosen column ``c`` (index
    0 is -1 for "none", index 1 is 0 for the root), which ``_assemble_tree`` reads parents from.

    One unique integer key per column: score desc (float bits are monotone for non-negative
    floats), then depth asc, then column asc, in bit fields ``[score | depth:12 | column:12]``;
    dead and duplicate columns last. The chosen columns are put in ascending order by a
    running count over a mask of them, not by a sort (one library call fewer per round).
    """
    bs, m = merged_score.shape
    device = merged_score.device
    cols = arange_cached(m, device)
    score_bits = merged_score.clamp(0.0, 1.0).float().view(torch.int32).long()
    key = torch.add(cols + (0x3F800000 << 24), depth, alpha=1 << 12)
    key = torch.where(is_canonical, torch.add(key, score_bits, alpha=-(1 << 24)), _DEAD_KEY)
    top = key.topk(min(slots, m), dim=1, largest=False, sorted=False).indices
    took = is_canonical.gather(1, top)
    marks = torch.zeros(bs, m + 2, dtype=torch.int64, device=device)  # [none, root, columns...]
    marks[:, 1] = 1
    marks.scatter_(1, top + 2, took.long())
    rank = marks.cumsum(dim=1) - 1
    # Chosen column c fills slot rank - 1; the others are sent to a spare slot, then dropped.
    slot = torch.where(marks[:, 2:] > 0, rank[:, 2:] - 1, slots)
    chosen = torch.full((bs, slots + 1), m + 1, dtype=torch.int64, device=device)
    chosen = chosen.scatter_(1, slot, cols.expand(bs, m))[:, :slots]
    return chosen, took.sum(dim=1), rank


@functools.lru_cache(maxsize=64)
def _templates(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources and bins (``[1, 2, 2]``), and scores (``[1, 2]``), of the two extra columns
    ``m`` (the root) and ``m + 1`` (filler) appended to the candidates in ``_assemble_tree``."""
    ints = torch.tensor([[[int(Source.ROOT), int(Source.FILLER)], [0, 0]]], device=device)
    return ints, torch.tensor([[1.0, 0.0]], device=device)


@functools.lru_cache(maxsize=64)
def _node_index(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, t - 1)`` for tree positions ``t < n``."""
    t = torch.arange(n, device=device)
    return t, t - 1


def _assemble_tree(
    root_tokens: torch.Tensor,
    cands: Candidates,
    chosen: torch.Tensor,
    num_real: torch.Tensor,
    rank: torch.Tensor,
    parent_key: torch.Tensor,
    scores: torch.Tensor,
) -> TokenTree:
    """The tree ``[root, chosen real columns ascending, filler chain]``.

    Columns ``m`` and ``m + 1`` are appended as the root and filler templates, so one gather
    per field builds every node. A chosen column's tree parent is the tree position of its
    canonical parent, read from ``rank`` (see ``_select_best``) at ``parent_key`` (that
    column + 2, or 1 for the root). Filler node ``t`` hangs under ``t - 1``, the first one
    under the root.
    """
    bs, m = cands.tokens.shape
    n = chosen.shape[1] + 1
    device = chosen.device
    index = F.pad(chosen, (1, 0), value=m)  # [bs, n]: the root template first
    tmpl_ints, tmpl_scores = _templates(device)
    ints = torch.cat(
        [
            torch.stack([cands.tokens, cands.sources, cands.bins], dim=1),
            torch.cat([root_tokens.long().view(bs, 1, 1).expand(bs, 1, 2), tmpl_ints.expand(bs, 2, 2)], dim=1),
        ],
        dim=2,
    ).gather(2, index.unsqueeze(1).expand(bs, 3, n))
    node_scores = torch.cat([scores.float(), tmpl_scores.expand(bs, 2)], dim=1).gather(1, index)
    key = F.pad(parent_key, (0, 2)).gather(1, index)  # the root template's key 0 means "none"
    t, t_minus_1 = _node_index(n, device)
    last_real = num_real.view(bs, 1)
    filler_parent = torch.where(t_minus_1 > last_real, t_minus_1, 0)
    parents = torch.where(t > last_real, filler_parent, rank.gather(1, key))
    ancestors = ancestor_mask(parents)
    return TokenTree(ints[:, 0], parents, ancestors.sum(dim=2) - 1, node_scores, ints[:, 1], ints[:, 2], ancestors)


def source_counts(tree: TokenTree) -> torch.Tensor:
    """``[bs, len(Source)]`` number of nodes of each source per request."""
    return torch.nn.functional.one_hot(tree.sources, len(Source)).sum(dim=1)
