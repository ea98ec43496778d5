"""Test oracles written the slow, obvious way (per-request Python loops), independent of
the batched implementations they check."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_graft.engine import EngineConfig, SpecEngine, int8_linear

# Where the engine tests put their models: the CPU in CI; scripts/gpu_check.sh runs the same
# tests with SGLANG_GRAFT_TEST_DEVICE=cuda, so the engine is checked on a GPU by its own suite.
TEST_DEVICE = torch.device(os.environ.get("SGLANG_GRAFT_TEST_DEVICE", "cpu"))

#: Every int8 kernel (``engine.int8_linear.KERNELS``), each skipped where it cannot run (naming why).
EACH_INT8_KERNEL = pytest.mark.parametrize(
    "kernel",
    [
        pytest.param(k, marks=pytest.mark.skipif(why is not None, reason=f"the {k} int8 kernel cannot run here: {why}"))
        for k, why in ((k, int8_linear.unavailable_reason(k)) for k in int8_linear.KERNELS)
    ],
)

INT8_PROMPTS = [[5, 9, 11, 3, 17, 5, 9, 11], [40, 41, 42, 43, 40, 41, 42], [7, 7, 8, 100, 7, 7, 8, 100, 7]]


def assert_int8_draft_lossless(
    target: torch.nn.Module, draft: torch.nn.Module, policy: str, kernel: str, **settings: object
) -> SpecEngine:
    """Greedy ``policy`` with ``draft`` as an int8 draft on ``kernel`` (and ``EngineConfig``
    ``settings``) decodes ``INT8_PROMPTS`` as ``ar`` does, with some draft tokens accepted;
    returns the engine."""
    ref = SpecEngine(target, None, EngineConfig(policy="ar")).generate(INT8_PROMPTS, 24)
    config = EngineConfig(
        policy=policy, num_nodes=8, draft_depth=3, draft_topk=3, draft_int8=True, draft_int8_kernel=kernel, **settings
    )
    engine = SpecEngine(target, draft, config)
    batch = engine.generate(INT8_PROMPTS, 24)
    assert [r.token_ids for r in batch.requests] == [r.token_ids for r in ref.requests]
    assert sum(r.accepted["draft"] for r in batch.requests) > 0, "no draft accepted: the test would prove nothing"
    return engine


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    """A random tree in topological order: node i > 0 hangs under a random earlier node."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def simulate_eagle_draft(bs: int, topk: int, steps: int, vocab: int, gen: torch.Generator):
    """Mimic EAGLE's draft loop (sglang ``select_top_k_tokens``) with random draft
    distributions: returns ``(score_list, token_list, parents_list)`` as the worker would."""
    score_list, token_list, parents_list = [], [], []
    probs = torch.softmax(torch.randn(bs, vocab, generator=gen) * 3, dim=-1)
    topk_p, topk_index = probs.topk(topk, dim=-1)
    scores = topk_p
    score_list.append(topk_p.unsqueeze(1))
    token_list.append(topk_index)
    parents_list.append(torch.arange(-1, topk).unsqueeze(0).repeat(bs, 1))
    for i in range(1, steps):
        probs = torch.softmax(torch.randn(bs * topk, vocab, generator=gen) * 3, dim=-1)
        topk_p, topk_index = probs.topk(topk, dim=-1)
        expand = scores.unsqueeze(2) * topk_p.reshape(-1, topk, topk)
        cs_p, cs_index = expand.flatten(1).topk(topk, dim=-1)
        scores = cs_p
        score_list.append(expand)
        token_list.append(topk_index.reshape(-1, topk * topk))
        parents_list.append(cs_index + (topk * topk * (i - 1) + topk))
    return score_list, token_list, parents_list


def eagle_kernel_oracle(verified_id, score_list, token_list, parents_list, seq_lens, topk, steps, n, full_mask):
    """SGLang's ``organize_draft_results`` + ``build_tree_efficient`` kernel, transliterated
    with one Python loop per request and per node (as the CUDA kernel's threads do)."""
    scores = torch.cat(score_list, dim=1).flatten(1)
    toks = torch.cat(token_list, dim=1)
    sel = torch.sort(torch.topk(scores, n - 1, dim=-1).indices).values
    draft = torch.gather(toks, 1, sel)
    parent_list = torch.cat(parents_list[:-1], dim=1) if len(parents_list) > 1 else torch.empty(len(seq_lens), 0)
    bs = len(seq_lens)
    draft_tokens = torch.cat([verified_id.unsqueeze(1), draft], dim=1).flatten()
    total = int(seq_lens.sum())
    mask = [True] * (total * n + n * n * bs) if full_mask else [True] * (n * n * bs)
    positions = [0] * (bs * n)
    r_index = [[-1] * n for _ in range(bs)]
    r_next = [[-1] * n for _ in range(bs)]
    r_sib = [[-1] * n for _ in range(bs)]
    for b in range(bs):
        seq_len = int(seq_lens[b])
        base = n * n * b + sum(int(seq_lens[i]) * n for i in range(b))
        sel_b = [int(x) for x in sel[b]]

        def parent_pos(tree_i: int) -> int:
            ptb = sel_b[tree_i - 1] // topk
            if ptb == 0:
                return 0
            tok_idx = int(parent_list[b, ptb])
            return sel_b.index(tok_idx) + 1

        for tid in range(n):
            row = base + (seq_len + n) * tid + seq_len if full_mask else n * n * b + n * tid
            for j in range(n):
                mask[row + j] = j == 0
            if tid == 0:
                positions[b * n] = seq_len
                for i in range(n - 1, 0, -1):
                    r_index[b][i] = b * n + i
                    p = parent_pos(i)
                    if r_next[b][p] == -1:
                        r_next[b][p] = i
                    else:
                        r_sib[b][i] = r_next[b][p]
                        r_next[b][p] = i
                r_index[b][0] = b * n
            else:
                depth, cur = 0, tid
                while cur != 0:
                    mask[row + cur] = True
                    depth += 1
                    cur = parent_pos(cur)
                positions[b * n + tid] = seq_len + depth
    return (
        torch.tensor(mask),
        torch.tensor(positions),
        torch.tensor(r_index),
        torch.tensor(r_next),
        torch.tensor(r_sib),
        draft_tokens,
    )


def naive_greedy_walk(tokens, parents, target_argmax, max_accept):
    """Per request: from the root, repeatedly step into the lowest-index child whose token
    equals the target's argmax at the current node. Returns (path columns, bonus)."""
    out = []
    for b in range(len(tokens)):
        n = len(tokens[b])
        path, cur = [0], 0
        while len(path) - 1 < max_accept:
            nxt = next(
                (c for c in range(n) if parents[b][c] == cur and tokens[b][c] == target_argmax[b][cur]),
                None,
            )
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        out.append((path, target_argmax[b][cur]))
    return out
