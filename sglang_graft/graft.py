"""Grafting: merge drafted and retrieved proposals into one verify tree of exactly ``n`` nodes.

All proposals hang off the same root and carry the same currency, the estimated
probability that the target accepts the whole path down to them. Grafting therefore is a
single best-first selection over the union:

1. **Summarise paths** by pointer jumping (``ceil(log2 depth)`` rounds of gathers): each
   node's root-path hash, depth, whether every node on the path is valid, and the minimum
   score on the path (so scores never increase from parent to child).
2. **Merge duplicates**: nodes with the same root path are one node. The lowest column
   (drafts come first) is kept, with the best score of the group; the others' children
   re-attach to it. A retrieved chain that repeats a draft path thus continues that path
   instead of spending slots on a copy.
3. **Select** the best ``n - 1`` by (score desc, depth asc, column asc). Because a parent
   scores at least as high as its child and is shallower, the chosen set is always
   ancestor-closed; the tie-break is total, so every process builds the same tree.
4. **Fill**: if fewer than ``n - 1`` real nodes exist, a chain of filler nodes (the root
   token repeated) takes the remaining slots so shapes stay static for CUDA graphs.

Path hashes are 64-bit polynomial hashes; a collision could only merge two distinct paths,
which changes which tokens are proposed, never what verification accepts, so it can cost
acceptance but cannot break losslessness.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sglang_graft.candidates import Candidates, Source, concat_candidates
from sglang_graft.tree import TokenTree, tree_from_selection

_HASH_BASE = 1_000_003  # odd multiplier; products wrap modulo 2**64 (int64 two's complement)
_HASH_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio constant as a signed int64


class PathSummary(NamedTuple):
    """Per-candidate facts about the path from the root down to it (all ``[bs, m]``)."""

    hash: torch.Tensor  # int64 hash of the token path
    depth: torch.Tensor  # int64, 1 for children of the root
    valid: torch.Tensor  # bool, every node on the path is valid
    min_score: torch.Tensor  # float32, smallest score on the path


def summarise_paths(c: Candidates, max_depth: int | None = None) -> PathSummary:
    """Pointer-jumping pass over a candidate forest.

    ``max_depth`` bounds the deepest path (default: the number of columns); it only sets
    how many jumping rounds run, ``ceil(log2(max_depth)) + 1``, with no host sync.
    """
    bs, m = c.tokens.shape
    if m == 0:
        z = torch.zeros(bs, 0, dtype=torch.int64, device=c.tokens.device)
        return PathSummary(z, z.clone(), z.bool(), z.float())
    bound = m if max_depth is None else max(1, min(max_depth, m))
    ptr = c.parents.clone()
    seg_hash = (c.tokens + 1) * _HASH_MIX
    seg_pow = torch.full_like(c.tokens, _HASH_BASE)
    depth = torch.ones_like(c.tokens)
    valid = c.valid.clone()
    min_score = c.scores.float().clone()
    for _ in range(math.ceil(math.log2(bound)) + 1):
        has = ptr >= 0
        p = ptr.clamp(min=0)
        up_hash = seg_hash.gather(1, p)
        seg_hash = torch.where(has, up_hash * seg_pow + seg_hash, seg_hash)
        seg_pow = torch.where(has, seg_pow * seg_pow.gather(1, p), seg_pow)
        depth = torch.where(has, depth + depth.gather(1, p), depth)
        valid = valid & (~has | valid.gather(1, p))
        min_score = torch.where(has, torch.minimum(min_score, min_score.gather(1, p)), min_score)
        ptr = torch.where(has, ptr.gather(1, p), ptr)
    return PathSummary(seg_hash, depth, valid, min_score)


class GraftResult(NamedTuple):
    tree: TokenTree
    num_merged: torch.Tensor  # [bs] int64: proposals that duplicated another's path


def graft(
    root_tokens: torch.Tensor,
    proposals: list[Candidates],
    num_nodes: int,
    max_depth: int | None = None,
) -> GraftResult:
    """Build the verify tree from the root and every proposer's candidates.

    Args:
        root_tokens: ``[bs]`` last verified token of each request.
        proposals: candidate sets, highest priority first (drafts before retrieval):
            on a duplicate path the earliest proposer keeps the node and its source.
        num_nodes: ``n``, the verify budget including the root (>= 2).
        max_depth: a bound on proposal depth, to skip needless jumping rounds.
    """
    if num_nodes < 2:
        raise ValueError(f"num_nodes (verify budget n) must be >= 2, got {num_nodes}")
    if not proposals:
        raise ValueError("graft needs at least one Candidates (use Candidates.empty for none)")
    bs = root_tokens.shape[0]
    device = root_tokens.device
    for c in proposals:
        if c.batch_size != bs:
            raise ValueError(f"proposals have batch size {c.batch_size}, root_tokens has {bs}")
    slots = num_nodes - 1
    cands = concat_candidates([*proposals, _filler_chain(root_tokens, slots)])
    m = cands.width
    bound = None if max_depth is None else max(max_depth, slots)
    summary = summarise_paths(cands, bound)

    # Merge: canonical[i] = lowest valid column with the same root path.
    cols = torch.arange(m, device=device)
    alive = summary.valid
    same = (summary.hash.unsqueeze(2) == summary.hash.unsqueeze(1)) & alive.unsqueeze(1) & alive.unsqueeze(2)
    canonical = torch.where(same, cols.view(1, 1, m), m).min(dim=2).values.clamp(max=m - 1)
    merged_score = torch.where(same, summary.min_score.unsqueeze(1), -1.0).max(dim=2).values
    is_canonical = alive & (canonical == cols)
    is_filler = cands.sources == int(Source.FILLER)
    num_merged = (alive & ~is_canonical & ~is_filler).sum(dim=1)
    parent_canon = torch.where(cands.parents >= 0, canonical.gather(1, cands.parents.clamp(min=0)), -1)

    # Best-first selection with a total order: real nodes by (score desc, depth asc,
    # column asc), then the filler chain in order, then everything dead.
    key = torch.where(is_canonical & ~is_filler, -merged_score, torch.where(is_canonical, 1.5, 3.0))
    order = torch.sort(summary.depth, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(key.gather(1, order), dim=1, stable=True).indices)
    selected = torch.sort(order[:, :slots], dim=1).values

    merged = Candidates(
        tokens=cands.tokens,
        parents=parent_canon,
        scores=torch.where(is_filler, 0.0, merged_score.clamp(min=0.0)),
        sources=cands.sources,
        valid=is_canonical,
        bins=cands.bins,
    )
    return GraftResult(tree_from_selection(root_tokens, merged, selected), num_merged)


def _filler_chain(root_tokens: torch.Tensor, length: int) -> Candidates:
    """A chain repeating the root token: the only guess left when every source is dry.

    It sorts after every real proposal, so it fills only slots nobody else wanted.
    """
    bs = root_tokens.shape[0]
    device = root_tokens.device
    cols = torch.arange(length, device=device)
    return Candidates(
        tokens=root_tokens.long().view(bs, 1).expand(bs, length).clone(),
        parents=(cols - 1).view(1, length).expand(bs, length).clone(),
        scores=torch.zeros(bs, length, device=device),
        sources=torch.full((bs, length), int(Source.FILLER), dtype=torch.int64, device=device),
        valid=torch.ones(bs, length, dtype=torch.bool, device=device),
    )


def source_counts(tree: TokenTree) -> torch.Tensor:
    """``[bs, len(Source)]`` number of nodes of each source per request."""
    return torch.nn.functional.one_hot(tree.sources, len(Source)).sum(dim=1)
