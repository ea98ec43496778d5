"""The tree type, its SGLang layout, and the EAGLE twin."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import eagle_kernel_oracle, random_parents, simulate_eagle_draft
from sglang_graft.candidates import Source
from sglang_graft.tree import (
    TokenTree,
    ancestor_mask,
    build_eagle_tree,
    child_links,
    child_links_by_count,
    child_links_by_sort,
    depths_from_parents,
    eagle_candidates,
    pack,
)


def _golden_draft():
    """A hand-traced EAGLE draft: topk=2, 3 steps (see test_build_eagle_tree_golden)."""
    score_list = [
        torch.tensor([[[0.6, 0.32]]]),
        torch.tensor([[[0.3, 0.12], [0.288, 0.016]]]),
        torch.tensor([[[0.24, 0.03], [0.144, 0.1152]]]),
    ]
    token_list = [torch.tensor([[10, 11]]), torch.tensor([[20, 21, 22, 23]]), torch.tensor([[30, 31, 32, 33]])]
    parents_list = [torch.tensor([[-1, 0, 1]]), torch.tensor([[2, 4]]), torch.tensor([[6, 8]])]
    return score_list, token_list, parents_list


def test_build_eagle_tree_golden():
    # Flattened candidates: 0:tok10 .6, 1:tok11 .32, 2:tok20 .3 (under 0), 3:tok21 .12,
    # 4:tok22 .288 (under 1), 5:tok23, 6:tok30 .24 (under 2), 7:tok31, 8:tok32, 9:tok33.
    # Best 5 = {0, 1, 2, 4, 6} -> tree root(7), 10, 11, 20<-10, 22<-11, 30<-20.
    s, t, p = _golden_draft()
    mask, pos, ridx, rnext, rsib, draft = build_eagle_tree(
        torch.tensor([7]), s, t, p, torch.tensor([4]), topk=2, spec_steps=3, num_verify_tokens=6, tree_mask_mode="qlen"
    )
    assert draft.tolist() == [7, 10, 11, 20, 22, 30]
    assert pos.tolist() == [4, 5, 5, 6, 6, 7]
    assert ridx.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert rnext.tolist() == [[1, 3, 4, 5, -1, -1]]
    assert rsib.tolist() == [[-1, 2, -1, -1, -1, -1]]
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert mask.view(6, 6).int().tolist() == expected
    full, *_ = build_eagle_tree(
        torch.tensor([7]), s, t, p, torch.tensor([4]), topk=2, spec_steps=3, num_verify_tokens=6
    )
    rows = full.view(6, 10)
    assert rows[:, :4].all()
    assert rows[:, 4:].int().tolist() == expected


@pytest.mark.parametrize("bs,topk,steps,n", [(1, 2, 3, 6), (3, 4, 3, 8), (2, 4, 5, 16), (4, 8, 4, 32), (2, 1, 4, 4)])
@pytest.mark.parametrize("mode", ["full", "qlen"])
def test_build_eagle_tree_matches_kernel_oracle(bs, topk, steps, n, mode):
    gen = torch.Generator().manual_seed(bs * 100 + topk * 10 + steps)
    s, t, p = simulate_eagle_draft(bs, topk, steps, vocab=64, gen=gen)
    verified = torch.randint(0, 64, (bs,), generator=gen)
    seq_lens = torch.randint(1, 9, (bs,), generator=gen)
    ours = build_eagle_tree(verified, s, t, p, seq_lens, topk, steps, n, tree_mask_mode=mode)
    ref = eagle_kernel_oracle(verified, s, t, p, seq_lens, topk, steps, n, full_mask=mode == "full")
    names = ["tree_mask", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling", "draft_tokens"]
    for name, a, b in zip(names, ours, ref):
        assert torch.equal(a.long(), b.long()), name


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_organize_draft_results_matches_sglang():
    """Our candidate selection equals SGLang's own ``organize_draft_results`` (CPU-safe part)."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    gen = torch.Generator().manual_seed(7)
    bs, topk, steps, n = 3, 4, 4, 12
    s, t, p = simulate_eagle_draft(bs, topk, steps, vocab=100, gen=gen)
    parent_list, top_idx, draft_tokens = organize_draft_results(s, t, p, n)
    verified = torch.randint(0, 100, (bs,), generator=gen)
    *_, ours_draft = build_eagle_tree(verified, s, t, p, torch.full((bs,), 5), topk, steps, n)
    assert torch.equal(ours_draft.view(bs, n)[:, 1:], draft_tokens)
    cands = eagle_candidates(s, t, p, topk)
    # Our flattened parents, read SGLang's way: parent_list[j // topk].
    group = torch.arange(cands.width) // topk
    assert torch.equal(cands.parents, parent_list.long()[:, group])


def _tree(parents: list[list[int]], tokens: list[list[int]] | None = None) -> TokenTree:
    par = torch.tensor(parents)
    tok = torch.tensor(tokens) if tokens is not None else torch.arange(par.numel()).view(par.shape) % 50
    bs, n = par.shape
    src = torch.full((bs, n), int(Source.DRAFT))
    src[:, 0] = int(Source.ROOT)
    return TokenTree(tok, par, depths_from_parents(par), torch.ones(bs, n), src, torch.zeros(bs, n, dtype=torch.long))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(2, 24), st.integers(0, 2**31 - 1), st.sampled_from(["full", "qlen"]))
def test_pack_invariants_on_random_trees(bs, n, seed, mode):
    gen = torch.Generator().manual_seed(seed)
    parents = [random_parents(n, gen) for _ in range(bs)]
    tree = _tree(parents)
    tree.validate()
    seq_lens = torch.randint(0, 7, (bs,), generator=gen)
    lay = pack(tree, seq_lens, mask_mode=mode)
    assert lay.draft_tokens.shape == (bs * n,)
    offset = 0
    for b in range(bs):
        par = parents[b]
        # Reference ancestor-or-self sets and depths by walking parents.
        for i in range(n):
            anc, cur, depth = {i}, i, 0
            while par[cur] >= 0:
                cur = par[cur]
                anc.add(cur)
                depth += 1
            assert int(lay.positions[b * n + i]) == int(seq_lens[b]) + depth
            if mode == "qlen":
                row = lay.tree_mask[b * n * n + i * n : b * n * n + (i + 1) * n]
            else:
                width = int(seq_lens[b]) + n
                full_row = lay.tree_mask[offset + i * width : offset + (i + 1) * width]
                assert full_row[: int(seq_lens[b])].all()
                row = full_row[int(seq_lens[b]) :]
            assert {j for j in range(n) if row[j]} == anc
        if mode == "full":
            offset += (int(seq_lens[b]) + n) * n
        # Links: following next_token then next_sibling enumerates exactly each node's children.
        for p in range(n):
            kids, c = [], int(lay.retrive_next_token[b, p])
            while c != -1:
                kids.append(c)
                c = int(lay.retrive_next_sibling[b, c])
            assert kids == [j for j in range(n) if par[j] == p]
        assert lay.retrive_index[b].tolist() == [b * n + i for i in range(n)]
    if mode == "full":
        assert lay.tree_mask.numel() == int(seq_lens.sum()) * n + n * n * bs
    # SGLang's kernels read every layout tensor through a raw pointer with row stride n.
    for name, t in lay._asdict().items():
        assert t.is_contiguous(), name


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(2, 70), st.integers(0, 2**31 - 1))
def test_child_links_by_count_equals_by_sort(bs, n, seed):
    """The compiled round's pairwise links are the eager round's sorted ones, bit for bit
    (``test_pack_invariants_on_random_trees`` checks those against a walk of the parents)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([random_parents(n, gen) for _ in range(bs)])
    for got, want in zip(child_links_by_count(parents), child_links_by_sort(parents)):
        assert got.dtype == want.dtype and got.is_contiguous()
        assert torch.equal(got, want)


def test_ancestor_mask_is_closed_and_links_match_parents():
    par = torch.tensor([[-1, 0, 0, 1, 3, 2, 4]])
    anc = ancestor_mask(par)[0]
    assert anc[6].nonzero().flatten().tolist() == [0, 1, 3, 4, 6]
    nxt, sib = child_links(par)
    assert nxt[0].tolist() == [1, 3, 5, 4, 6, -1, -1]
    assert sib[0].tolist() == [-1, 2, -1, -1, -1, -1, -1]


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: _tree([[-1, 0, 2, 1]]), "earlier column"),
        (lambda: _tree([[-1]]), "n >= 2"),
        (lambda: _tree([[-1, 0, 1]], [[1, -3, 2]]), "negative token id"),
        (lambda: _tree([[0, 0, 1]]), "root"),
    ],
)
def test_tree_validate_rejects_bad_input(make, needle):
    with pytest.raises(ValueError, match=needle):
        make().validate(vocab_size=50)


def test_tree_validate_rejects_out_of_vocab_and_nan():
    tree = _tree([[-1, 0, 1]], [[1, 99, 2]])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 50\)"):
        tree.validate(vocab_size=50)
    bad = _tree([[-1, 0, 1]])
    bad.scores[0, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        bad.validate()


def test_build_eagle_tree_rejects_bad_input():
    s, t, p = _golden_draft()
    with pytest.raises(ValueError, match="num_verify_tokens must be >= 2"):
        build_eagle_tree(torch.tensor([7]), s, t, p, torch.tensor([4]), 2, 3, 1)
    with pytest.raises(ValueError, match="needs 19 draft candidates"):
        build_eagle_tree(torch.tensor([7]), s, t, p, torch.tensor([4]), 2, 3, 20)
    with pytest.raises(ValueError, match="expected 2 draft steps"):
        build_eagle_tree(torch.tensor([7]), s, t, p, torch.tensor([4]), 2, 2, 6)
    with pytest.raises(ValueError, match="mask_mode"):
        build_eagle_tree(torch.tensor([7]), s, t, p, torch.tensor([4]), 2, 3, 6, tree_mask_mode="bits")
    s_nan = [x.clone() for x in s]
    s_nan[1][0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        build_eagle_tree(torch.tensor([7]), s_nan, t, p, torch.tensor([4]), 2, 3, 6)
    with pytest.raises(ValueError, match="negative token id"):
        build_eagle_tree(torch.tensor([-7]), s, t, p, torch.tensor([4]), 2, 3, 6)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        build_eagle_tree(torch.tensor([7]), s, t, p, torch.tensor([4, 5]), 2, 3, 6)
