"""The one tree type that flows from drafting to verification, and its SGLang layout.

A ``TokenTree`` holds ``n`` nodes per request (node 0 is the root: the last verified token),
in topological order (every parent before its children). The same object is built by the
EAGLE twin (``build_eagle_tree``) and by Graft's prune-then-graft scheduler, and is packed
into exactly the tensors SGLang's verify path reads, so Graft never needs a second tree
representation and falls back to plain EAGLE by construction.

SGLang conventions reproduced here (sglang 0.5.23, ``eagle_utils.py`` and the
``build_tree_efficient`` CUDA kernel):

* ``retrive_index[b, i] = b * n + i``; ``positions = seq_len + depth``;
* ``retrive_next_token[b, p]`` is the lowest-index child of ``p``, and
  ``retrive_next_sibling[b, i]`` the next higher-index child of the same parent (-1: none);
* the tree mask is ancestor-or-self, either ``full`` (per request ``n`` rows of
  ``seq_len + n`` columns, prefix columns all True, requests one after another) or
  ``qlen`` (``n x n`` per request).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from sglang_graft.candidates import Candidates, Source

MASK_MODES = ("full", "qlen")


@dataclass(frozen=True)
class TokenTree:
    """A batch of speculation trees with exactly ``n`` nodes each.

    Attributes (all ``[bs, n]``):
        tokens:  int64 token ids; column 0 is the root (the last verified token).
        parents: int64 parent column, ``-1`` for the root, ``parents[:, i] < i`` otherwise.
        depths:  int64 distance from the root (root 0).
        scores:  float32 estimated P(path accepted); the root is 1.
        sources: int64 ``Source`` codes (``Source.ROOT`` at column 0).
        bins:    int64 calibration bucket of each node's proposer (see ``Candidates.bins``).
        ancestors: ``[bs, n, n]`` bool ancestor-or-self mask, derived from ``parents`` once
            when not given, so packing and verification never recompute it.
        links: ``(next_token, next_sibling)`` as ``child_links`` returns them, when the
            builder already has them (read them with ``TokenTree.child_links``).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    sources: torch.Tensor
    bins: torch.Tensor
    ancestors: torch.Tensor = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    links: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.ancestors is None:
            object.__setattr__(self, "ancestors", ancestor_mask(self.parents))

    def child_links(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(next_token, next_sibling)`` of ``child_links(self.parents)``, computed once."""
        if self.links is None:
            object.__setattr__(self, "links", child_links(self.parents))
        assert self.links is not None
        return self.links

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first broken invariant."""
        if self.tokens.dim() != 2:
            raise ValueError(f"TokenTree.tokens must be [bs, n], got shape {tuple(self.tokens.shape)}")
        bs, n = self.tokens.shape
        if n < 2:
            raise ValueError(f"a verify tree needs n >= 2 nodes (root + at least one proposal), got n={n}")
        for name in ("parents", "depths", "scores", "sources", "bins"):
            if getattr(self, name).shape != (bs, n):
                raise ValueError(f"TokenTree.{name} has shape {tuple(getattr(self, name).shape)}, expected {(bs, n)}")
        _check_token_range("TokenTree.tokens", self.tokens, vocab_size)
        if bool((self.parents[:, 0] != -1).any()):
            raise ValueError("TokenTree root (column 0) must have parent -1")
        cols = torch.arange(n, device=self.parents.device)
        p = self.parents[:, 1:]
        if bool(((p < 0) | (p >= cols[1:])).any()):
            raise ValueError("TokenTree.parents must point to an earlier column (a parent after its child)")
        if bool(torch.isnan(self.scores).any()):
            raise ValueError("TokenTree.scores contains NaN")
        expected = depths_from_parents(self.parents)
        if not torch.equal(expected, self.depths):
            raise ValueError("TokenTree.depths disagree with parents")


class VerifyLayout(NamedTuple):
    """The verify-side tensors of SGLang's ``EagleVerifyInput`` for one tree batch."""

    tree_mask: torch.Tensor  # bool, flattened, see module docstring
    positions: torch.Tensor  # [bs * n] int64
    retrive_index: torch.Tensor  # [bs, n] int64
    retrive_next_token: torch.Tensor  # [bs, n] int64
    retrive_next_sibling: torch.Tensor  # [bs, n] int64
    draft_tokens: torch.Tensor  # [bs * n] int64


def _check_token_range(name: str, tokens: torch.Tensor, vocab_size: int | None) -> None:
    if tokens.numel() == 0:
        return
    lo = int(tokens.min())
    if lo < 0:
        raise ValueError(f"{name} holds negative token id {lo}")
    if vocab_size is not None:
        hi = int(tokens.max())
        if hi >= vocab_size:
            raise ValueError(f"{name} holds token id {hi}, outside the vocabulary [0, {vocab_size})")


@functools.lru_cache(maxsize=256)
def arange_cached(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` (int64), built once per ``(n, device)``: index tensors are the same every
    round, and one small op costs about as much as the work it does. Never write into it."""
    return torch.arange(n, device=device)


def ancestor_lists(parents: torch.Tensor, length: int) -> torch.Tensor:
    """``[bs, n + 1, L]`` int64, ``L >= length``: row ``i`` lists ``i``, its parent, its
    grandparent, ... padded with the sentinel ``n`` (row ``n`` is the sentinel's own row).

    Pointer doubling: the list of ``2k`` ancestors of ``i`` is its first ``k`` followed by
    the first ``k`` of its ``k``-th ancestor, so ``ceil(log2 length)`` gathers suffice and
    nothing waits on the device. Parents outside ``[0, n)`` (``-1``: the root) end the path.
    """
    bs, n = parents.shape
    device = parents.device
    # Map every non-column (-1, or garbage >= n) to the sentinel n, which points to itself.
    ptr = torch.where((parents >= 0) & (parents < n), parents, n)
    ptr = torch.cat([ptr, torch.full((bs, 1), n, dtype=torch.int64, device=device)], dim=1)
    lists = arange_cached(n + 1, device).view(1, n + 1, 1).expand(bs, n + 1, 1)
    while lists.shape[2] < length:
        width = lists.shape[2]
        lists = torch.cat([lists, lists.gather(1, ptr.unsqueeze(2).expand(bs, n + 1, width))], dim=2)
        ptr = ptr.gather(1, ptr)
    return lists


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[bs, n, n]`` bool, ``[b, i, j]`` True iff node ``j`` is ``i`` or one of its ancestors.

    Scatters each node's ancestor list (``ancestor_lists``): ``O(n^2)`` work in
    ``ceil(log2 n)`` gathers, with no data-dependent loop and no matmul.
    """
    bs, n = parents.shape
    lists = ancestor_lists(parents, n)[:, :n]
    mask = torch.zeros(bs, n, n + 1, dtype=torch.bool, device=parents.device)
    return mask.scatter_(2, lists, True)[:, :, :n].contiguous()


def depths_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (root 0) from its parent column."""
    return ancestor_mask(parents).sum(dim=2) - 1


#: A compiled round orders trees of up to this many ``[request, node, node]`` cells by
#: comparing every pair of nodes (one fused loop) instead of sorting (a library call that a
#: CPU package pays microseconds of dispatch for); eager PyTorch always sorts, since there
#: each pairwise op costs as much as the sort and the ``[bs, n, n]`` temporaries grow fast.
COUNTING_MAX_CELLS = 4096


def child_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(next_token, next_sibling)``: each node's lowest-index child, and its next
    higher-index sibling; ``-1`` where there is none. This is the order SGLang's
    ``build_tree_efficient`` kernel produces and its verify kernels walk.

    ``parents`` must be a tree (the root at column 0 with parent -1, every other parent an
    earlier column). Both ways of computing the links (``child_links_by_sort`` and, for
    small compiled rounds, ``child_links_by_count``) return the same contiguous tensors:
    SGLang's kernels read them through raw pointers with row stride n.
    """
    bs, n = parents.shape
    if torch.compiler.is_compiling() and bs * n * n <= COUNTING_MAX_CELLS:
        return child_links_by_count(parents)
    return child_links_by_sort(parents)


def child_links_by_count(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``child_links`` by comparing every pair of nodes: ``O(n^2)`` work per request."""
    bs, n = parents.shape
    cols = arange_cached(n, parents.device)
    # [b, i, j]: is j a child of i; is j a later sibling of i. The lowest such j, else n.
    first_child = torch.where(parents.unsqueeze(1) == cols.view(n, 1), cols, n).amin(dim=2)
    siblings = (parents.unsqueeze(1) == parents.unsqueeze(2)) & (cols.view(1, n) > cols.view(n, 1))
    next_sibling = torch.where(siblings, cols, n).amin(dim=2)
    return torch.where(first_child < n, first_child, -1), torch.where(next_sibling < n, next_sibling, -1)


def child_links_by_sort(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``child_links`` in ``O(n log n)``: sorting the nodes by ``(parent, column)`` lines up
    each parent's children in index order, so one sort and two scatters give both links."""
    bs, n = parents.shape
    device = parents.device
    order = torch.add(arange_cached(n, device), parents, alpha=n).argsort(dim=1)  # the root first
    by_parent = parents.gather(1, order)
    later, parent_of_later = order[:, 1:], by_parent[:, 1:]
    same = parent_of_later == by_parent[:, :-1]  # sorted neighbours k, k + 1 are siblings
    none = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    next_sibling = none.scatter(1, order[:, :-1], torch.where(same, later, -1))
    # The first of each run of siblings is its parent's first child; the rest go to a spare column.
    first_child = torch.full((bs, n + 1), -1, dtype=torch.int64, device=device)
    first_child.scatter_(1, torch.where(same, n, parent_of_later), later)
    return first_child[:, :n].contiguous(), next_sibling


def pack(
    tree: TokenTree,
    seq_lens: torch.Tensor,
    mask_mode: str = "full",
    seq_lens_sum: int | None = None,
) -> VerifyLayout:
    """Lay a tree batch out the way SGLang's tree-attention verify reads it.

    Args:
        tree: the batch of trees, ``n`` nodes each.
        seq_lens: ``[bs]`` verified sequence length per request (the root's position).
        mask_mode: ``"full"`` (FlashInfer/Triton FULL_MASK) or ``"qlen"`` (QLEN_ONLY).
        seq_lens_sum: ``seq_lens.sum()`` if the caller already has it on the host.
    """
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
    bs, n = tree.tokens.shape
    if seq_lens.shape != (bs,):
        raise ValueError(f"seq_lens must have shape ({bs},) like the tree batch, got {tuple(seq_lens.shape)}")
    device = tree.tokens.device
    if seq_lens.dtype != torch.int64 or seq_lens.device != device:
        seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    next_token, next_sibling = tree.child_links()
    if mask_mode == "qlen":
        tree_mask = tree.ancestors.reshape(-1)
    else:
        total = int(seq_lens.sum()) if seq_lens_sum is None else int(seq_lens_sum)
        if bs == 1:  # one block of n rows: the tree columns are the last n of each row
            tree_mask = torch.ones(n, total + n, dtype=torch.bool, device=device)
            tree_mask[:, total:] = tree.ancestors[0]
            tree_mask = tree_mask.view(-1)
        else:
            tree_mask = torch.ones(total * n + n * n * bs, dtype=torch.bool, device=device)
            tree_mask[_full_mask_index(seq_lens, n)] = tree.ancestors.reshape(-1)
    return VerifyLayout(
        tree_mask=tree_mask,
        positions=torch.add(tree.depths, seq_lens.view(bs, 1)).view(-1),
        retrive_index=torch.arange(bs * n, device=device).view(bs, n),
        retrive_next_token=next_token,
        retrive_next_sibling=next_sibling,
        draft_tokens=tree.tokens.reshape(-1),
    )


def _full_mask_index(seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """``[bs * n * n]`` flat positions of the tree columns in the ``full`` mask: request ``b``
    starts at ``start_b``, after the earlier requests' ``n`` rows of ``seq_len + n`` columns,
    and the tree part of its row ``r`` right after that row's ``seq_len`` prefix columns:
    ``start_b + r * (seq_len_b + n) + seq_len_b + c = start_b + (r + 1) * seq_len_b + (r * n + c)``.
    """
    bs = seq_lens.shape[0]
    within, rows_after = _mask_index_terms(n, seq_lens.device)
    index = torch.addcmul(within, rows_after, seq_lens.view(bs, 1))  # [bs, n * n], as if start_b = 0
    if bs > 1:  # the first request starts at 0
        block = (seq_lens + n) * n
        index += (torch.cumsum(block, dim=0) - block).view(bs, 1)
    return index.reshape(-1)


@functools.lru_cache(maxsize=64)
def _mask_index_terms(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r * n + c, r + 1)`` for every tree cell ``(r, c)`` of an ``n x n`` block, flat."""
    cells = torch.arange(n * n, device=device)
    return cells, torch.div(cells, n, rounding_mode="floor") + 1


def tree_from_selection(
    root_tokens: torch.Tensor,
    candidates: Candidates,
    selected: torch.Tensor,
) -> TokenTree:
    """Build a tree from the root and ``n - 1`` chosen candidate columns per request.

    ``selected`` (``[bs, n-1]`` int64) must be sorted ascending and ancestor-closed; since a
    candidate's parent always has a lower column, ascending column order is topological.
    A selected node whose parent was not selected (possible only at exact score ties) is
    hung under the root, which keeps the tree valid and verification exact.
    """
    bs, k = selected.shape
    device = selected.device
    tokens = torch.cat([root_tokens.view(bs, 1).long(), candidates.tokens.gather(1, selected)], dim=1)
    cand_parent = candidates.parents.gather(1, selected)  # candidate column or -1
    # Position of each selected node's parent among the selected columns (+1 for the root).
    match = selected.unsqueeze(1) == cand_parent.unsqueeze(2)  # [bs, k, k]
    found = match.any(dim=2)
    parent_pos = torch.where(found, match.long().argmax(dim=2) + 1, torch.zeros_like(cand_parent))
    parents = torch.cat([torch.full((bs, 1), -1, dtype=torch.int64, device=device), parent_pos], dim=1)
    scores = torch.cat([torch.ones(bs, 1, device=device), candidates.scores.gather(1, selected).float()], dim=1)
    sources = torch.cat(
        [torch.full((bs, 1), int(Source.ROOT), dtype=torch.int64, device=device), candidates.sources.gather(1, selected)],
        dim=1,
    )
    bins = torch.cat([torch.zeros(bs, 1, dtype=torch.int64, device=device), candidates.bins.gather(1, selected)], dim=1)
    ancestors = ancestor_mask(parents)
    return TokenTree(tokens, parents, ancestors.sum(dim=2) - 1, scores, sources, bins, ancestors)


def flatten_eagle_steps(
    score_list: Sequence[torch.Tensor],
    token_list: Sequence[torch.Tensor],
    parents_list: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate EAGLE's per-step draft outputs: ``(scores [bs, m], tokens [bs, m],
    parent_list [bs, p])``.

    EAGLE's draft loop (sglang ``select_top_k_tokens``) records, per step ``i``, the
    cumulative scores ``[bs, 1 or topk, topk]``, the tokens ``[bs, topk or topk^2]`` and,
    in ``parents_list[i]``, which flattened candidates were expanded;
    ``parent_list = cat(parents_list[:-1])`` (entry 0, ``-1``, is the root). Only
    concatenations: it may run inside a CUDA graph.
    """
    scores = torch.cat([s.flatten(1) for s in score_list], dim=1)
    tokens = torch.cat(list(token_list), dim=1)
    if len(parents_list) > 1:
        parent_list = torch.cat(list(parents_list[:-1]), dim=1)
    else:
        parent_list = torch.full((tokens.shape[0], 1), -1, dtype=torch.int64, device=tokens.device)
    return scores, tokens, parent_list


def candidates_from_flat(scores: torch.Tensor, tokens: torch.Tensor, parent_list: torch.Tensor, topk: int) -> Candidates:
    """Draft candidates from ``flatten_eagle_steps``'s tensors.

    A candidate at flattened column ``j`` hangs under ``parent_list[:, j // topk]``; its
    depth follows from the layout (step 0 yields ``topk`` children of the root, each later
    step ``topk^2`` nodes one level deeper). Only shapes are checked (no device sync).
    """
    if scores.shape != tokens.shape:
        raise ValueError(
            f"EAGLE draft outputs disagree: scores {tuple(scores.shape)} vs tokens {tuple(tokens.shape)}"
        )
    bs, m = tokens.shape
    if topk < 1 or parent_list.shape[0] != bs or (m - 1) // topk >= parent_list.shape[1]:
        raise ValueError(
            f"EAGLE parent_list {tuple(parent_list.shape)} covers too few expansion slots: {m} candidates "
            f"with topk={topk} need {(m - 1) // max(topk, 1) + 1} for each of {bs} requests"
        )
    slot, depths = _eagle_layout(m, topk, tokens.device)
    tokens = tokens.long()
    return Candidates(
        tokens=tokens,
        parents=parent_list.long().index_select(1, slot),
        scores=scores.float(),
        sources=torch.full_like(tokens, int(Source.DRAFT)),
        valid=torch.ones_like(tokens, dtype=torch.bool),
        depths=depths.expand(bs, m),
    )


@functools.lru_cache(maxsize=64)
def _eagle_layout(m: int, topk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expansion slot [m], depth [1, m])`` of each flattened EAGLE candidate column."""
    cols = torch.arange(m, device=device)
    return cols // topk, torch.where(cols < topk, 1, 2 + (cols - topk) // (topk * topk)).view(1, m)


def eagle_candidates(
    score_list: Sequence[torch.Tensor],
    token_list: Sequence[torch.Tensor],
    parents_list: Sequence[torch.Tensor],
    topk: int,
) -> Candidates:
    """EAGLE's per-step draft outputs as one candidate set (see ``flatten_eagle_steps``)."""
    return candidates_from_flat(*flatten_eagle_steps(score_list, token_list, parents_list), topk)


def build_eagle_tree(
    bonus_tokens: torch.Tensor,
    score_list: Sequence[torch.Tensor],
    token_list: Sequence[torch.Tensor],
    parents_list: Sequence[torch.Tensor],
    seq_lens: torch.Tensor,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: str = "full",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain EAGLE's verify tree: SGLang's ``organize_draft_results`` followed by
    ``build_tree_kernel_efficient``, element for element, in plain PyTorch.

    Returns ``(tree_mask, positions, retrive_index, retrive_next_token,
    retrive_next_sibling, draft_tokens)``.
    """
    if num_verify_tokens < 2:
        raise ValueError(f"num_verify_tokens must be >= 2, got {num_verify_tokens}")
    if len(score_list) != spec_steps:
        raise ValueError(f"expected {spec_steps} draft steps (spec_steps), got {len(score_list)}")
    cands = eagle_candidates(score_list, token_list, parents_list, topk)
    if bool(torch.isnan(cands.scores).any()):
        raise ValueError("EAGLE draft scores contain NaN")
    if cands.width < num_verify_tokens - 1:
        raise ValueError(
            f"num_verify_tokens={num_verify_tokens} needs {num_verify_tokens - 1} draft candidates, "
            f"EAGLE produced {cands.width} (topk={topk}, spec_steps={spec_steps})"
        )
    _check_token_range("bonus_tokens", bonus_tokens, None)
    selected = torch.sort(torch.topk(cands.scores, num_verify_tokens - 1, dim=-1).indices, dim=-1).values
    tree = tree_from_selection(bonus_tokens, cands, selected)
    return tuple(pack(tree, seq_lens, tree_mask_mode))  # type: ignore[return-value]
