"""Seeded drafting: retrieved nodes fed to the draft model in its first forward.

The draft must score each seed exactly as a plain forward over the seed's path would
(the product of its own next-token probabilities), draft children below every seed from
the same forward, drop root children that repeat a seed, and keep the KV of seeds the
target accepts so the next round reads only what is new.
"""

from __future__ import annotations

import pytest
import torch

from helpers import TEST_DEVICE
from sglang_graft.candidates import Candidates, Source
from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models
from sglang_graft.engine.draft_head import DraftHead
from sglang_graft.engine.drafter import ModelDrafter

PROMPT = [7, 3, 9, 3, 11, 5]


@pytest.fixture(scope="module")
def draft64():
    torch.set_num_threads(1)
    return tiny_models("qwen2", vocab_size=64, seed=2, hidden=32, dtype=torch.float64)[1]


def _next_probs(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)


def _seeds(tokens: list[int], parents: list[int], valid: list[bool] | None = None) -> Candidates:
    t = torch.tensor([tokens])
    return Candidates(
        tokens=t,
        parents=torch.tensor([parents]),
        scores=torch.full(t.shape, 0.5),
        sources=torch.full(t.shape, int(Source.CONTEXT)),
        valid=torch.tensor([valid or [True] * len(tokens)]),
        bins=torch.arange(5, 5 + len(tokens)).view(1, -1),
    )


def _never(depth: int, scores: torch.Tensor) -> torch.Tensor:
    return torch.zeros(scores.shape[0], dtype=torch.bool)


def test_seeds_are_scored_and_expanded_like_fresh_forwards(draft64):
    top_root = _next_probs(draft64, PROMPT).topk(2)
    a = int(top_root.indices[0])  # a seed the draft itself would propose: its root-child copy is dropped
    b, c = 17, 23
    seeds = _seeds([a, b, c], [-1, 0, -1])
    drafter = ModelDrafter(draft64, topk=2, depth=1, vocab_limit=64, batch_size=1, device="cpu")
    assert drafter.cold().tolist() == [True]
    with torch.inference_mode():
        out = drafter.draft(torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.bool), _never, seeds)
    assert drafter.cold().tolist() == [False]
    cands = out.candidates
    assert out.forwards == 1 and out.read_tokens == len(PROMPT) - 1
    p_root, p_a, p_ab, p_c = (_next_probs(draft64, PROMPT + s) for s in ([], [a], [a, b], [c]))
    want_seed = torch.tensor([p_root[a], p_root[a] * p_a[b], p_root[c]])
    torch.testing.assert_close(cands.scores[0, :3].double(), want_seed.double(), rtol=1e-5, atol=1e-9)
    assert cands.tokens[0, :3].tolist() == [a, b, c] and cands.parents[0, :3].tolist() == [-1, 0, -1]
    # Root children (columns 3, 4): the draft's top-2; the copy of seed `a` is invalid.
    assert cands.tokens[0, 3:5].tolist() == top_root.indices.tolist()
    assert cands.valid[0, 3:5].tolist() == [False, True]
    # Seed children (columns 5..10): each seed's top-2 under its own path.
    for j, (probs, score) in enumerate(zip((p_a, p_ab, p_c), want_seed)):
        cols = slice(5 + 2 * j, 7 + 2 * j)
        top = probs.topk(2)
        assert cands.parents[0, cols].tolist() == [j, j]
        assert cands.tokens[0, cols].tolist() == top.indices.tolist()
        want = (score * top.values).double()
        torch.testing.assert_close(cands.scores[0, cols].double(), want, rtol=1e-5, atol=1e-9)
    # Seed `a`'s child `b`, if the draft proposes it, repeats seed `b` and is dropped too.
    repeats = (cands.parents[0, 5:7] == 0) & (cands.tokens[0, 5:7] == b)
    assert not bool((cands.valid[0, 5:7] & repeats).any())
    assert cands.levels is not None and cands.levels.eq(1).all()
    # Seeds keep the retrieval source and bin that proposed them; the rest is the draft's.
    assert cands.sources[0, :3].tolist() == [int(Source.CONTEXT)] * 3
    assert cands.bins[0, :3].tolist() == [5, 6, 7]
    assert cands.sources[0, 3:].eq(int(Source.DRAFT)).all()


def test_seeds_are_scored_over_the_draft_heads_columns(draft64):
    """With a head over part of the vocabulary the draft's distribution is renormalised
    over the kept ids: a kept seed scores its probability there, one outside the head 0
    (the draft could never propose it), and children are kept tokens."""
    keep = 20
    head = DraftHead(draft64, keep, [PROMPT], 64)
    kept, dropped = 17, 40  # 17 < keep; 40 is neither low nor in the prompt
    drafter = ModelDrafter(draft64, topk=2, depth=1, vocab_limit=64, batch_size=1, device="cpu", head=head)
    with torch.inference_mode():
        out = drafter.draft(
            torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.bool), _never, _seeds([kept, dropped], [-1, -1])
        )
    with torch.inference_mode():
        logits = draft64(torch.tensor([PROMPT])).logits[0, -1]
    p_root = torch.softmax(logits[head.ids].float(), dim=-1)
    cands = out.candidates
    want = p_root[int(head.columns[kept])]
    torch.testing.assert_close(cands.scores[0, 0].double(), want.double(), rtol=1e-5, atol=1e-9)
    assert float(cands.scores[0, 1]) < 1e-29  # 0, up to the 1e-30 floor of the path product's log
    top = p_root.topk(2)
    assert cands.tokens[0, 2:4].tolist() == head.ids[top.indices].tolist()
    torch.testing.assert_close(cands.scores[0, 2:4].double(), top.values.double(), rtol=1e-5, atol=1e-9)
    drafted = cands.tokens[cands.valid & (cands.sources == int(Source.DRAFT))]
    assert bool(torch.isin(drafted, head.ids).all())


def _count_reads(model, reads: list[int]):
    return model.register_forward_pre_hook(lambda m, args, kw: reads.append(kw["input_ids"].shape[1]), with_kwargs=True)


def test_accepted_seeds_keep_their_kv(draft64):
    a, b, c = 17, 23, 40
    reads: list[int] = []
    handle = _count_reads(draft64, reads)
    try:
        drafter = ModelDrafter(draft64, topk=2, depth=2, vocab_limit=64, batch_size=1, device="cpu")
        always = lambda d, s: torch.ones(s.shape[0], dtype=torch.bool)  # noqa: E731
        with torch.inference_mode():
            prompt, seeds = torch.tensor([PROMPT]), _seeds([a, b, c], [-1, 0, -1])
            drafter.draft(prompt, torch.ones_like(prompt, dtype=torch.bool), always, seeds)
            # The target accepted seeds a, b and emitted the bonus 5: only 5 is new.
            out = drafter.draft(torch.tensor([[a, b, 5]]), torch.ones(1, 3, dtype=torch.bool), _never)
    finally:
        handle.remove()
    assert reads == [len(PROMPT) + 3, 2, 1]
    want = _next_probs(draft64, PROMPT + [a, b, 5]).topk(2)
    assert out.candidates.tokens[0].tolist() == want.indices.tolist()
    torch.testing.assert_close(out.candidates.scores[0].double(), want.values.double(), rtol=1e-5, atol=1e-9)


def test_invalid_seeds_are_neither_proposed_nor_reused(draft64):
    drafter = ModelDrafter(draft64, topk=2, depth=1, vocab_limit=64, batch_size=1, device="cpu")
    with torch.inference_mode():
        out = drafter.draft(
            torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.bool), _never,
            _seeds([17, 23], [-1, 0], valid=[False, False]),
        )
        assert not bool(out.candidates.valid[0, :2].any())
        assert not bool(out.candidates.valid[0, 4:].any())  # their children
        assert out.candidates.scores[0, :2].tolist() == [0.0, 0.0]
        # Verified 17, 23 then 5: nothing fed matches an invalid seed, so all three are read.
        reads: list[int] = []
        handle = _count_reads(draft64, reads)
        try:
            drafter.draft(torch.tensor([[17, 23, 5]]), torch.ones(1, 3, dtype=torch.bool), _never)
        finally:
            handle.remove()
    assert reads == [3]


@pytest.mark.parametrize("seed_draft", [True, False])
def test_seeded_graft_is_lossless(seed_draft):
    torch.set_num_threads(1)
    target, draft = (m.to(TEST_DEVICE) for m in tiny_models("llama", vocab_size=120, seed=4, hidden=32))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 1, 9, 2, 9, 1, 9], [3, 4]]
    ref = SpecEngine(target, None, EngineConfig(policy="ar")).generate(prompts, 30)
    config = EngineConfig(policy="graft", num_nodes=8, draft_depth=3, draft_topk=2, seed_draft=seed_draft)
    out = SpecEngine(target, draft, config).generate(prompts, 30)
    assert [r.token_ids for r in out.requests] == [r.token_ids for r in ref.requests]
    assert sum(r.tau for r in out.requests) > len(prompts), "no proposal was ever accepted"


def test_depth_gates_cut_at_the_drafting_level_not_the_depth():
    """A level-1 node below a depth-2 seed is depth 3; a gate that stops after level 1 keeps it."""
    from sglang_graft.prune import ConfidencePruner, GateConfig

    t = torch.tensor([[4, 5, 6, 7]])
    drafts = Candidates(
        tokens=t,
        parents=torch.tensor([[-1, 0, 1, -1]]),
        scores=torch.full(t.shape, 0.9),
        sources=torch.full(t.shape, int(Source.DRAFT)),
        valid=torch.ones(t.shape, dtype=torch.bool),
        levels=torch.tensor([[1, 1, 1, 2]]),
    )
    kept = ConfidencePruner(GateConfig(mode="fixed")).prune(drafts, torch.tensor([1]))
    assert kept.valid.tolist() == [[True, True, True, False]]


def test_pruning_keeps_the_bins_of_retrieved_seeds():
    """Draft nodes get their confidence bucket; a seed keeps its retrieval bin (its source learns from it)."""
    from sglang_graft.calibration import confidence_bins
    from sglang_graft.prune import ConfidencePruner, GateConfig

    t = torch.tensor([[4, 5, 6]])
    raw = torch.tensor([[0.9, 0.5, 0.05]])
    drafts = Candidates(
        tokens=t,
        parents=torch.tensor([[-1, 0, -1]]),
        scores=raw,
        sources=torch.tensor([[int(Source.CONTEXT), int(Source.DRAFT), int(Source.RECYCLING)]]),
        valid=torch.ones(t.shape, dtype=torch.bool),
        bins=torch.tensor([[11, 0, 3]]),
    )
    pruner = ConfidencePruner(GateConfig(mode="fixed"))
    kept = pruner.prune(drafts, torch.tensor([3]))
    draft_bin = int(confidence_bins(raw, pruner.config.num_bins)[0, 1])
    assert kept.bins.tolist() == [[11, draft_bin, 3]]
