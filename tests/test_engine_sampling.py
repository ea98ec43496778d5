"""Sampling through the engine: reproducible with a seed, and distributed like the target."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import TEST_DEVICE
from sglang_graft.engine import EngineConfig, SamplingConfig, SpecEngine, tiny_models
from sglang_graft.verify import target_distribution

PROMPT = [1, 2, 3, 4, 5, 2, 3]


@pytest.fixture(scope="module")
def small_vocab():
    torch.set_num_threads(1)
    return tuple(m.to(TEST_DEVICE) for m in tiny_models("llama", vocab_size=12, seed=3, hidden=32, draft_noise=0.2))


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.09: p = 0.001)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize(
    "policy,sampling",
    [
        ("ar", SamplingConfig(temperature=1.0)),
        ("dense", SamplingConfig(temperature=1.0)),
        ("graft", SamplingConfig(temperature=1.0)),
        ("graft", SamplingConfig(temperature=0.7, top_p=0.9, top_k=6)),
    ],
)
def test_first_token_follows_target_distribution(small_vocab, policy, sampling):
    target, draft = small_vocab
    trials = 3000
    engine = SpecEngine(target, draft, EngineConfig(policy=policy, num_nodes=4, draft_depth=2, draft_topk=3))
    out = engine.generate([PROMPT] * trials, max_new_tokens=2, sampling=sampling, seed=11)
    first = torch.tensor([r.token_ids[0] for r in out.requests])
    with torch.no_grad():
        logits = target(torch.tensor([PROMPT], device=TEST_DEVICE)).logits[0, -1].cpu()
    p = target_distribution(logits, sampling.temperature, sampling.top_p, sampling.top_k).double()
    counts = torch.bincount(first, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0, "sampled a token the target distribution excludes"
    expected = p * trials
    big = expected >= 5
    stat = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    df = int(big.sum()) - 1
    assert stat < _chi2_critical(df), f"chi2={stat:.1f} over {df} dof: first token is not target-distributed"
    if policy != "ar":
        accepted = sum(sum(r.accepted.values()) for r in out.requests)
        assert accepted > trials // 10, "too few accepted proposals to exercise the rejection sampler"


def test_sampling_is_reproducible_with_a_seed():
    torch.set_num_threads(1)
    target, draft = (m.to(TEST_DEVICE) for m in tiny_models("qwen2", vocab_size=200, seed=2, hidden=32))
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    engine = SpecEngine(target, draft, EngineConfig(policy="dense", num_nodes=6))
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    a = engine.generate(prompts, 16, sampling, seed=7)
    b = engine.generate(prompts, 16, sampling, seed=7)
    c = engine.generate(prompts, 16, sampling, seed=8)
    assert [r.token_ids for r in a.requests] == [r.token_ids for r in b.requests]
    assert [r.token_ids for r in a.requests] != [r.token_ids for r in c.requests]
