"""Greedy losslessness of the reference engine: every policy equals plain decoding.

Tiny random models in float32 (peaked logits, no numeric near-ties) of three
architectures; prompts of different lengths so batches need left padding; verify budgets
n = 4 and 16; batch sizes 1 and 3. ``ar`` itself is checked against transformers' own
greedy ``generate``.
"""

from __future__ import annotations

import pytest
import torch

from helpers import TEST_DEVICE
from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models

ARCHS = ("llama", "qwen2", "qwen3")
SPEC_POLICIES = ("dense", "pruned", "retrieval", "graft")
NEW_TOKENS = 20
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18, 11, 12, 13, 14, 15, 16, 17, 18, 11, 12, 13, 14, 15],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
    [42, 7],
]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    torch.set_num_threads(1)
    target, draft = (m.to(TEST_DEVICE) for m in tiny_models(request.param, vocab_size=200, seed=1, hidden=32))
    engine = SpecEngine(target, draft, EngineConfig(policy="ar"))
    ref = [engine.generate([p], NEW_TOKENS).requests[0].token_ids for p in PROMPTS]
    return target, draft, ref


def test_ar_matches_transformers_greedy(pair):
    target, _, ref = pair
    for p, r in zip(PROMPTS, ref):
        out = target.generate(torch.tensor([p], device=TEST_DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        assert out[0, len(p) :].tolist() == r
    batched = SpecEngine(target, None, EngineConfig(policy="ar")).generate(PROMPTS, NEW_TOKENS)
    assert [r.token_ids for r in batched.requests] == ref
    assert all(r.tau == 1.0 for r in batched.requests)
    # The batch's rows share one timed prefill, a part of the call's wall time.
    prefills = {r.prefill_s for r in batched.requests}
    assert len(prefills) == 1 and 0 < prefills.pop() < batched.elapsed_s


@pytest.mark.parametrize("n", [4, 16])
@pytest.mark.parametrize("policy", SPEC_POLICIES)
def test_policy_equals_ar(pair, policy, n):
    target, draft, ref = pair
    engine = SpecEngine(target, draft, EngineConfig(policy=policy, num_nodes=n, draft_depth=3, draft_topk=3))
    for p, r in zip(PROMPTS[:2], ref):
        out = engine.generate([p], NEW_TOKENS).requests[0]
        assert out.token_ids == r, f"{policy} n={n} bs=1 diverged from ar on prompt {p}"
        assert out.verify_tokens == n * out.rounds
    batch = engine.generate(PROMPTS, NEW_TOKENS)
    for i, (out, r) in enumerate(zip(batch.requests, ref)):
        assert out.token_ids == r, f"{policy} n={n} bs=3 diverged from ar on prompt {i}"
        assert len(out.margins) == NEW_TOKENS and min(out.margins) > 0
    accepted = sum(sum(r.accepted.values()) for r in batch.requests)
    assert accepted > 0, f"{policy} accepted no proposal at all: the test would prove nothing"
    if policy == "retrieval":
        assert all(r.draft_forwards == 0 for r in batch.requests)


def test_graft_uses_draft_and_retrieval(pair):
    target, draft, _ = pair
    engine = SpecEngine(target, draft, EngineConfig(policy="graft", num_nodes=8))
    outs = [engine.generate(PROMPTS, 32).requests for _ in range(2)]  # the second run has history
    totals: dict[str, int] = {}
    for run in outs:
        for r in run:
            for k, v in r.accepted.items():
                totals[k] = totals.get(k, 0) + v
    assert totals["draft"] > 0
    assert totals["recycling"] + totals["context"] + totals["history"] > 0
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]]


def test_stop_token_ends_like_ar(pair):
    target, draft, ref = pair
    stop = ref[1][6]
    first = ref[1].index(stop)
    ar = SpecEngine(target, None, EngineConfig(policy="ar"), stop_token_ids=[stop]).generate([PROMPTS[1]], NEW_TOKENS)
    graft = SpecEngine(target, draft, EngineConfig(policy="graft"), stop_token_ids=[stop]).generate(
        PROMPTS, NEW_TOKENS
    )
    assert ar.requests[0].token_ids == ref[1][: first + 1]
    assert ar.requests[0].finish_reason == "stop"
    assert graft.requests[1].token_ids == ref[1][: first + 1]
    assert graft.requests[1].finish_reason == "stop"
