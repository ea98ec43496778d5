"""Our tree building and greedy verification against SGLang 0.5.23's own kernels.

SGLang's Triton kernels (``sglang/kernels/ops/speculative/spec_tree.py``) run here through
Triton's CPU interpreter (see conftest.py); skipped where sglang is not installed.
"""

from __future__ import annotations

import pytest
import torch

from helpers import random_parents, simulate_eagle_draft
from sglang_graft.tree import build_eagle_tree, child_links

spec_tree = pytest.importorskip("sglang.kernels.ops.speculative.spec_tree")
eagle_utils = pytest.importorskip("sglang.srt.speculative.eagle_utils")


def _sglang_tree(verified, s, t, p, seq_lens, topk, steps, n, mode):
    parent_list, top_idx, draft = eagle_utils.organize_draft_results(s, t, p, n)
    bs = len(seq_lens)
    size = int(seq_lens.sum()) * n + n * n * bs if mode == 0 else n * n * bs
    tree_mask = torch.full((size,), True)
    positions = torch.empty(bs * n, dtype=torch.long)
    ri = torch.full((bs, n), -1, dtype=torch.long)
    rn, rs = ri.clone(), ri.clone()
    spec_tree.sgl_build_tree_kernel_triton(parent_list, top_idx, seq_lens, tree_mask, positions, ri, rn, rs, topk, steps, n, mode)
    return tree_mask, positions, ri, rn, rs, torch.cat([verified.unsqueeze(1), draft], dim=1).flatten()


@pytest.mark.parametrize("bs,topk,steps,n", [(1, 2, 3, 6), (3, 4, 3, 8), (2, 8, 4, 24)])
@pytest.mark.parametrize("mode", ["full", "qlen"])
def test_build_eagle_tree_equals_sglang(bs, topk, steps, n, mode):
    gen = torch.Generator().manual_seed(11 * bs + topk + steps)
    s, t, p = simulate_eagle_draft(bs, topk, steps, vocab=80, gen=gen)
    verified = torch.randint(0, 80, (bs,), generator=gen)
    seq_lens = torch.randint(1, 10, (bs,), generator=gen)
    ours = build_eagle_tree(verified, s, t, p, seq_lens, topk, steps, n, tree_mask_mode=mode)
    theirs = _sglang_tree(verified, s, t, p, seq_lens, topk, steps, n, 0 if mode == "full" else 1)
    names = ["tree_mask", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling", "draft_tokens"]
    for name, a, b in zip(names, ours, theirs):
        assert torch.equal(a.long(), b.long()), name


@pytest.mark.parametrize("seed", range(6))
def test_verify_tree_greedy_equals_sglang(seed):
    from sglang_graft.verify import verify_tree_greedy

    gen = torch.Generator().manual_seed(seed)
    bs, n, vocab, spec = 3, 10, 4, 5
    parents = torch.tensor([random_parents(n, gen) for _ in range(bs)])
    nxt, sib = child_links(parents)
    ridx = torch.arange(bs * n).view(bs, n)
    cand = torch.randint(0, vocab, (bs, n), generator=gen)
    target = torch.randint(0, vocab, (bs, n), generator=gen)
    ours = verify_tree_greedy(cand, ridx, nxt, sib, target, spec)
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, spec), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    spec_tree.verify_tree_greedy_triton(predicts, accept_index, accept_num, cand, ridx, nxt, sib, target)
    assert torch.equal(ours[0], predicts)
    assert torch.equal(ours[1], accept_index)
    assert torch.equal(ours[2], accept_num)
