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

import math
from typing import NamedTuple

import torch

from sglang_graft.candidates import Candidates, Source, concat_candidates
from sglang_graft.tree import TokenTree, tree_from_selection

_HASH_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constant (golden ratio), as signed int64
_HASH_BASE = 0x100000001B3  # odd multiplier for depth powers; products wrap modulo 2**64


class PathSummary(NamedTuple):
    """Per-candidate facts about the path from the root down to it."""

    ancestors: torch.Tensor  # [bs, m, m] bool, ancestor-or-self (the root excluded)
    depth: torch.Tensor  # [bs, m] int64, 1 for children of the root
    valid: torch.Tensor  # [bs, m] bool, every node on the path is valid
    min_score: torch.Tensor  # [bs, m] float32, smallest score on the path
    path_hash: torch.Tensor  # [bs, m] int64 hash of the root-to-node token path


def summarise_paths(c: Candidates) -> PathSummary:
    """Path facts for every candidate, from the forest's ancestor matrix."""
    bs, m = c.tokens.shape
    device = c.tokens.device
    if m == 0:
        z = torch.zeros(bs, 0, dtype=torch.int64, device=device)
        return PathSummary(z.view(bs, 0, 0).bool(), z, z.bool(), z.float(), z)
    eye = torch.eye(m, device=device).expand(bs, m, m)
    step = torch.zeros(bs, m, m, device=device)
    step.scatter_(2, c.parents.clamp(min=0).unsqueeze(2), (c.parents >= 0).float().unsqueeze(2))
    reach = eye + step
    for _ in range(math.ceil(math.log2(max(m, 2)))):
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
    depth = reach.sum(dim=2)
    invalid_above = torch.bmm(reach, (~c.valid).float().unsqueeze(2)).squeeze(2)
    ancestors = reach > 0
    min_score = torch.where(ancestors, c.scores.float().unsqueeze(1), 2.0).min(dim=2).values
    depth = depth.long()
    powers = torch.full((m + 1,), _HASH_BASE, dtype=torch.int64, device=device).cumprod(dim=0)
    contrib = (c.tokens + 1) * _HASH_MIX * powers[depth.clamp(max=m)]
    path_hash = (ancestors.long() * contrib.unsqueeze(1)).sum(dim=2)
    return PathSummary(ancestors, depth, invalid_above == 0, min_score, path_hash)


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
    device = root_tokens.device
    for c in proposals:
        if c.batch_size != bs:
            raise ValueError(f"proposals have batch size {c.batch_size}, root_tokens has {bs}")
    slots = num_nodes - 1
    filler = _filler_chain(root_tokens, slots)
    cands = concat_candidates(list(proposals))
    m = cands.width
    if m == 0:  # every source dry: the whole tree is filler
        only_filler = torch.arange(slots, device=device).expand(bs, slots)
        return GraftResult(tree_from_selection(root_tokens, filler, only_filler), torch.zeros(bs, dtype=torch.int64, device=device))
    summary = summarise_paths(cands)

    # Merge: canonical[i] = lowest live column with the same root path.
    cols = torch.arange(m, device=device)
    alive = summary.valid
    same = summary.path_hash.unsqueeze(2) == summary.path_hash.unsqueeze(1)
    same &= alive.unsqueeze(1) & alive.unsqueeze(2)
    canonical = torch.where(same, cols.view(1, 1, m), m).min(dim=2).values.clamp(max=m - 1)
    merged_score = torch.where(same, summary.min_score.unsqueeze(1), -1.0).max(dim=2).values
    is_canonical = alive & (canonical == cols)
    num_merged = (alive & ~is_canonical).sum(dim=1)
    parent_canon = torch.where(cands.parents >= 0, canonical.gather(1, cands.parents.clamp(min=0)), -1)

    # One unique integer key per column: score desc (float bits are monotone for
    # non-negative floats), then depth asc, then column asc; dead columns last.
    score_bits = merged_score.clamp(0.0, 1.0).float().view(torch.int32).long()
    key = ((0x3F800000 - score_bits) << 24) | (summary.depth << 12) | cols
    key = torch.where(is_canonical, key, torch.iinfo(torch.int64).max - m + cols)
    real = torch.sort(key, dim=1).indices[:, : min(slots, m)]
    num_real = is_canonical.sum(dim=1, keepdim=True)

    merged = concat_candidates(
        [
            Candidates(
                tokens=cands.tokens,
                parents=parent_canon,
                scores=merged_score.clamp(min=0.0),
                sources=cands.sources,
                valid=is_canonical,
                bins=cands.bins,
            ),
            filler,
        ]
    )
    # Slot k takes the k-th best real node while there are enough, else filler k - num_real.
    k = torch.arange(slots, device=device).expand(bs, slots)
    padded = torch.cat([real, torch.zeros(bs, slots - real.shape[1], dtype=torch.int64, device=device)], dim=1)
    chosen = torch.where(k < num_real, padded, m + k - num_real)
    return GraftResult(tree_from_selection(root_tokens, merged, torch.sort(chosen, dim=1).values), num_merged)


def _filler_chain(root_tokens: torch.Tensor, length: int) -> Candidates:
    """A chain repeating the root token: the only guess left when every source is dry.

    Its parents are relative to the filler block itself (``concat_candidates`` shifts
    them); it is used only for slots no real proposal wanted.
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
