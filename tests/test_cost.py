"""Cost-aware drafting: the depth budget, the draft-or-retrieve decision, and that a decoder
which skips drafting in some rounds still decodes exactly like plain greedy."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sglang_graft.cost import DepthBudget, DraftOrRetrieve, VerifyCost
from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: DepthBudget(0.0, 4), "draft_cost_ratio"),
        (lambda: DepthBudget(-1.0, 4), "draft_cost_ratio"),
        (lambda: DepthBudget(0.3, 0), "max_depth"),
        (lambda: DepthBudget(0.3, 4, ema=1.0), "ema"),
        (lambda: DraftOrRetrieve(0.0), "draft_cost_ratio"),
        (lambda: DraftOrRetrieve(0.3, ema=-0.1), "ema"),
        (lambda: DraftOrRetrieve(0.3, explore_every=0), "explore_every"),
        (lambda: DraftOrRetrieve(0.3, read_cost=-1.0), "read_cost"),
        (lambda: DraftOrRetrieve(0.3, warmup=0), "warmup"),
        (lambda: VerifyCost([(2, 1.0), (8, 1.2)]), "starting at 1 token"),
        (lambda: VerifyCost([(1, 1.0)]), "at least two"),
        (lambda: VerifyCost([(1, 1.0), (8, 1.2), (8, 1.3)]), "increase strictly, got 8 then 8"),
        (lambda: VerifyCost([(1, 1.0), (8, 0.0)]), "at 8 tokens must be a finite number > 0, got 0.0"),
        (lambda: VerifyCost([(1, 1.0), (8, float("nan"))]), "finite"),
        (lambda: VerifyCost.parse("1:1,8"), "tokens:cost pairs"),
        (lambda: VerifyCost("1:1,8:1.2"), "VerifyCost.parse"),
        (lambda: VerifyCost.parse("1:1,eight:2"), "tokens:cost pairs"),
    ],
)
def test_bad_settings_name_the_value(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


def test_depth_budget_rejects_depth_zero():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        DepthBudget(0.3, 4).continues(0, torch.tensor([0.5]))


def test_depth_budget_extremes():
    cheap, dear = DepthBudget(1e-6, 6), DepthBudget(50.0, 6)
    q = torch.tensor([0.9, 0.01])
    assert cheap.continues(1, q).tolist() == [True, True]  # free drafts always pay
    assert dear.continues(1, q).tolist() == [False, False]  # a forward 50x the verify never does
    last = DepthBudget(1e-6, 3)
    for d in (1, 2):
        last.continues(d, q)
    assert last.continues(3, q).tolist() == [False, False]  # nothing deeper than max_depth


@settings(max_examples=50, deadline=None)
@given(st.floats(0.05, 2.0), st.floats(0.0, 1.0), st.integers(2, 8))
def test_depth_budget_matches_the_rate_formula(ratio, q, max_depth):
    """At depth 1 (survival still its prior 0.8 at every level) the decision is exactly
    the docstring's inequality, written out here the slow way: some look-ahead of h levels
    adds more expected tokens than plain decoding emits in its h draft forwards."""
    got = bool(DepthBudget(ratio, max_depth).continues(1, torch.tensor([q], dtype=torch.float64)))
    gains = [q * sum(0.8**j for j in range(1, h + 1)) for h in range(1, max_depth)]
    assert got == any(g > h * ratio for h, g in enumerate(gains, start=1))


def test_depth_budget_learns_survival():
    budget = DepthBudget(0.3, 6, ema=0.5)
    for _ in range(30):
        budget.continues(1, torch.tensor([0.8, 0.6]))
        budget.continues(2, torch.tensor([0.4, 0.3]))
    assert budget.survival[1].item() == pytest.approx(0.5, abs=1e-6)
    assert budget.survival[2].item() == pytest.approx(0.8)  # never observed: still the prior


def test_draft_or_retrieve_weighs_extra_tokens_against_the_long_run_rate():
    gate = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.5, warmup=1)
    strong = torch.tensor([[0.9, 0.6, 0.3, 0.0]])
    weak = torch.tensor([[0.1, 0.05, 0.0, 0.0]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    assert gate.wants_draft(weak, valid, 3).tolist() == [True]  # nothing drafted yet: draft
    gate.observe(3.0, 2)  # drafted: 3 tokens for 2 * 0.5 = 1 extra unit
    # R, from a prior round of plain decoding (1 token, 1 unit) and this one (3 tokens, 2 units).
    assert gate.rate.value == pytest.approx((0.5 + 1.5) / (0.5 + 1.0))
    assert gate.wants_draft(strong, valid, 3).tolist() == [False]  # 3 - (1 + 1.8) = 0.2 < 4/3 * 1
    assert gate.wants_draft(weak, valid, 3).tolist() == [True]  # 3 - 1.15 = 1.85 > 4/3
    # Invalid columns count for nothing, and only the best `slots` nodes count.
    assert gate.wants_draft(strong, torch.tensor([[False, False, True, True]]), 3).tolist() == [True]  # 1.7
    assert gate.wants_draft(strong, valid, 1).tolist() == [False]  # 3 - 1.9 = 1.1 < 4/3


def test_draft_or_retrieve_skips_a_dry_moment_of_a_fast_request():
    """Retrieval has nothing for a fresh token (the start of a copied span): at plain
    decoding's rate drafting pays, but not when the request has been copying at four
    tokens per unit, since the draft's 1.5 extra tokens are worth less than its forward."""
    dry = torch.zeros(1, 4)
    valid = torch.zeros(1, 4, dtype=torch.bool)
    slow = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.5, explore_every=100, warmup=1)
    slow.observe(2.5, 1)  # drafted rounds yield 2.5 tokens for 0.5 extra units
    assert slow.rate.value < 2.0
    assert slow.wants_draft(dry, valid, 3).tolist() == [True]  # 1.5 > R * 0.5
    fast = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.5, explore_every=100, warmup=1)
    fast.observe(2.5, 1)
    for _ in range(20):
        fast.observe(4.0, 0)  # retrieval-only rounds copying 4 tokens each
    assert fast.rate.value == pytest.approx(4.0, rel=1e-4)
    assert fast.wants_draft(dry, valid, 3).tolist() == [False]  # 1.5 < 4 * 0.5


def test_draft_or_retrieve_charges_a_dearer_drafted_verify():
    """With trimmed trees a drafted round also verifies more nodes: the difference between
    the verify costs of drafted and retrieval-only rounds is charged like draft forwards."""
    dry = torch.zeros(1, 4)
    valid = torch.zeros(1, 4, dtype=torch.bool)
    flat = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.5, explore_every=100, warmup=1)
    dear = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.5, explore_every=100, warmup=1)
    for gate, drafted_verify in ((flat, 1.0), (dear, 3.0)):
        gate.observe(2.0, 1, verify_cost=drafted_verify)
        gate.observe(2.0, 0, verify_cost=1.0)
    assert dear.drafted_verify == pytest.approx(2.0) and dear.skipped_verify == pytest.approx(1.0)
    # Both: drafted rounds yield 2 tokens, retrieval predicts nothing, so the draft adds 1
    # token for 0.5 forward units: flat drafts (R = 1.75 / 1.125, 1 > 0.78); dear also pays
    # 1 more verify unit and does not (R = 1.75 / 1.625, 1 < 1.08 * 1.5).
    assert flat.wants_draft(dry, valid, 3).tolist() == [True]
    assert dear.wants_draft(dry, valid, 3).tolist() == [False]


def test_draft_or_retrieve_learns_when_retrieval_disappoints():
    gate = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.5, explore_every=100, warmup=1)
    valid = torch.ones(1, 2, dtype=torch.bool)
    proposal = torch.tensor([[0.5, 0.4]])  # predicts 0.9 tokens past the bonus
    gate.observe(2.5, 2)
    assert gate.wants_draft(proposal, valid, 2).tolist() == [False]  # 2.5 - 1.9 = 0.6 < 1
    for _ in range(10):  # retrieval-only rounds that yield the bonus token alone
        gate.wants_draft(proposal, valid, 2)
        gate.observe(1.0, 0)
    assert gate.realism < 0.01
    assert gate.wants_draft(proposal, valid, 2).tolist() == [True]  # 2.5 - 1 = 1.5 > 1


def test_draft_or_retrieve_explores_after_a_bad_start():
    """A drafted round that looked hopeless must not lock drafting out: every
    ``explore_every`` retrieval-only rounds the batch drafts once and re-measures."""
    gate = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.2, explore_every=3, warmup=1)
    valid = torch.ones(1, 2, dtype=torch.bool)
    proposal = torch.tensor([[0.5, 0.4]])
    gate.observe(1.0, 2)  # a drafted round that yielded the bonus alone: 0.5 per unit
    decisions = []
    for _ in range(8):
        draft = bool(gate.wants_draft(proposal, valid, 2))
        decisions.append(draft)
        gate.observe(7.0 if draft else 1.9, 2 if draft else 0)
    # Skip three, explore; the drafted mean, (0.2 * 1 + 7) / 1.2 = 6 tokens, then adds 4.1
    # over 1.9 for 1 unit, more than R (3.3): keep drafting.
    assert decisions == [False, False, False, True, True, True, True, True]


def test_draft_or_retrieve_drafts_through_its_warmup():
    """One drafted round is a poor sample (the first token of an answer is often one the
    draft misses): until ``warmup`` drafted rounds are observed every request drafts, even
    when the first yielded the bonus alone and retrieval looks strong."""
    gate = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.9, explore_every=100, warmup=3)
    strong = torch.tensor([[0.9, 0.8]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    decisions = []
    for tokens in (1.0, 1.0, 1.0, 1.0):
        decisions.append(bool(gate.wants_draft(strong, valid, 2)))
        gate.observe(tokens, 2)
    # Three drafted rounds, then the yields decide: 1 token drafted vs 2.7 retrieved.
    assert decisions == [True, True, True, False]


@settings(max_examples=40, deadline=None)
@given(
    yields=st.lists(st.tuples(st.floats(1.0, 9.0), st.integers(1, 6)), min_size=1, max_size=12),
    ema=st.floats(0.0, 0.95),
)
def test_drafted_yield_weighs_every_drafted_round_alike(yields, ema):
    """The drafted yield and forwards are exponentially weighted means in which the first
    drafted round weighs what any other does (a running average seeded with its first sample
    kept an unlucky first round at 1 / (1 - ema) rounds' weight); retrieval-only rounds in
    between leave them alone."""
    gate = DraftOrRetrieve(draft_cost_ratio=0.5, ema=ema)
    assert gate.drafted_tokens is None and gate.drafted_forwards is None
    for tokens, forwards in yields:
        gate.observe(tokens, forwards)
        gate.observe(1.5, 0)
    weights = [ema ** (len(yields) - 1 - i) for i in range(len(yields))]
    total = sum(weights)
    assert gate.drafted_tokens == pytest.approx(sum(w * t for w, (t, _) in zip(weights, yields)) / total)
    assert gate.drafted_forwards == pytest.approx(sum(w * f for w, (_, f) in zip(weights, yields)) / total)
    assert gate.drafted_rounds == len(yields)


def test_draft_or_retrieve_charges_an_unread_prompt():
    """A drafter that would first prefill a long prompt is charged for it: the request that
    has read everything drafts, the one with 2000 unread tokens stays on retrieval, and an
    exploration round drafts only the warm one."""
    gate = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.5, explore_every=4, read_cost=0.03, warmup=1)
    gate.observe(3.0, 2)  # drafted: 3 tokens for 2 * 0.5 = 1 extra unit
    proposal = torch.tensor([[0.2, 0.1], [0.2, 0.1]])  # retrieval alone: 1.3 tokens
    valid = torch.ones(2, 2, dtype=torch.bool)
    unread = torch.tensor([1, 2000])
    # Extra tokens 3 - 1.3 = 1.7 for 1 unit warm; cold, 2000 * 0.03 * 0.5 / 4 = 7.5 more units.
    assert gate.wants_draft(proposal, valid, 2, unread).tolist() == [True, False]
    assert gate.wants_draft(proposal, valid, 2).tolist() == [True, True]  # None: nothing charged
    strong = torch.tensor([[0.9, 0.8], [0.9, 0.8]])  # 3 - 2.7 = 0.3 extra tokens: both skip
    for _ in range(4):
        assert gate.wants_draft(strong, valid, 2, unread).tolist() == [False, False]
        gate.observe(2.7, 0)
    assert gate.wants_draft(strong, valid, 2, unread).tolist() == [True, False]  # explore the warm one


def test_a_cold_drafter_with_a_short_prompt_drafts_at_once():
    """A drafter that has read nothing drafts when reading its prompt costs at most
    ``explore_every`` draft forwards, even where retrieval alone looks better; a long
    prompt, or a warm drafter with as many unread tokens, is left to the yields."""
    gate = DraftOrRetrieve(draft_cost_ratio=0.5, ema=0.5, explore_every=4, read_cost=0.05, warmup=1)
    gate.observe(3.0, 2)
    strong = torch.tensor([[0.9, 0.8]] * 4)  # retrieval alone: 2.7 tokens, drafting adds 0.3
    valid = torch.ones(4, 2, dtype=torch.bool)
    unread = torch.tensor([80, 81, 80, 5])  # 80 * 0.05 = 4 forwards: the limit
    cold = torch.tensor([True, True, False, True])
    assert gate.wants_draft(strong, valid, 2, unread, cold).tolist() == [True, False, False, True]
    assert gate.wants_draft(strong, valid, 2, unread).tolist() == [False] * 4  # no coldness known


@pytest.mark.parametrize("pattern", [(True, False), (True, False, False, False), (True,) + (False,) * 30])
def test_skipped_draft_rounds_stay_lossless(pattern):
    """Rounds that skip the draft decode exactly like ``ar`` (that the drafter's cache
    catches up correctly is checked in test_engine_kv.py)."""
    torch.set_num_threads(1)
    target, draft = tiny_models("qwen2", vocab_size=200, seed=3, hidden=32)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 1, 9, 2, 9], [3]]
    ref = SpecEngine(target, None, EngineConfig(policy="ar")).generate(prompts, 24)
    engine = SpecEngine(target, draft, EngineConfig(policy="graft", num_nodes=6, draft_depth=3, draft_topk=2))
    assert engine.scheduler is not None
    decisions = itertools.cycle(pattern)
    engine.scheduler.wants_draft = lambda retrieved, unread, cold: next(decisions)
    out = engine.generate(prompts, 24)
    assert [r.token_ids for r in out.requests] == [r.token_ids for r in ref.requests]
    rounds = out.requests[0].rounds
    assert 0 < out.requests[0].draft_forwards < rounds * 3  # some rounds drafted, some did not


def test_verify_cost_is_relative_monotone_and_linear():
    cost = VerifyCost.parse("1:150,2:120,8:180,16:240")
    assert cost.points == ((1, 150.0), (2, 120.0), (8, 180.0), (16, 240.0))
    assert cost(1) == 1.0
    assert cost(2) == 1.0  # a dip below the one-token cost is noise: never cheaper than fewer tokens
    assert cost(5) == pytest.approx(1.1)
    assert cost(12) == pytest.approx(1.4)
    assert cost(32) == pytest.approx(2.4)  # beyond the last point: the last segment's slope


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(2, 12),
    st.floats(0.0, 6.0),
    st.lists(st.floats(1.0, 3.0), min_size=3, max_size=3),
    st.integers(0, 2**31 - 1),
)
# Zero-score nodes tie in exact arithmetic; a float32 reference once ranked them 1 ulp apart.
@example(bs=1, n=11, rate=0.0, costs=[1.0, 1.0, 1.0], seed=7)
def test_best_width_maximises_tokens_minus_rate_times_cost(bs, n, rate, costs, seed):
    """Brute force over every width: the chosen one maximises the expected tokens of the
    best w - 1 nodes per request minus ``rate`` times the batch's relative verify cost."""
    curve = VerifyCost([(1, 1.0), (4, costs[0]), (16, costs[0] + costs[1]), (64, costs[0] + costs[1] + costs[2])])
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(bs, n, generator=gen) * (torch.rand(bs, n, generator=gen) > 0.3)
    scores[:, 0] = 1.0
    w = curve.best_width(scores, rate)

    def objective(width: int) -> float:
        kept = sum(float(row[1:].double().sort(descending=True).values[: width - 1].sum()) for row in scores) / bs
        return kept - rate * curve(bs * width) / curve(bs)

    values = {width: objective(width) for width in range(2, n + 1)}
    assert 2 <= w <= n
    assert values[w] >= max(values.values()) - 1e-9
    assert all(values[k] < values[w] - 1e-9 for k in range(2, w)), "ties go to the narrower tree"


def test_best_width_flat_cost_keeps_every_real_node_and_steep_cost_few():
    scores = torch.tensor([[1.0, 0.9, 0.6, 0.3, 0.05, 0.0, 0.0, 0.0]])
    assert VerifyCost([(1, 1.0), (64, 1.0)]).best_width(scores, rate=3.0) == 5  # the fillers go
    steep = VerifyCost([(1, 1.0), (2, 1.0), (8, 2.2)])  # 0.2 per extra slot
    assert steep.best_width(scores, rate=2.0) == 3  # 0.9 and 0.6 beat 0.4; 0.3 does not
    assert steep.best_width(scores, rate=0.0) == 5


def test_trimmed_trees_decode_like_plain_greedy():
    """With a steep verify cost every policy but dense verifies fewer than n nodes in some
    rounds, and still emits exactly plain greedy's tokens (float32 tiny models, bs 1 and 3)."""
    torch.set_num_threads(1)
    target, draft = tiny_models("qwen2", vocab_size=200, seed=1, hidden=32)
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 11, 12, 13, 14, 15, 16, 17, 18, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6], [42, 7]]
    ref = [r.token_ids for r in SpecEngine(target, None, EngineConfig(policy="ar")).generate(prompts, 20).requests]
    curve = ((1, 1.0), (2, 1.0), (4, 1.3), (16, 3.0))
    for policy in ("pruned", "retrieval", "graft"):
        config = EngineConfig(policy=policy, num_nodes=12, draft_depth=3, draft_topk=3, verify_costs=curve)
        engine = SpecEngine(target, draft, config)
        for batch in (prompts[:1], prompts):
            out = engine.generate(batch, 20).requests
            assert [r.token_ids for r in out] == ref[: len(batch)], f"{policy} bs={len(batch)} diverged from ar"
            assert all(r.verify_tokens < 12 * r.rounds for r in out), f"{policy} never trimmed its tree"
        assert sum(sum(r.accepted.values()) for r in out) > 0, f"{policy} accepted nothing: the test proves nothing"
    dense = SpecEngine(target, draft, EngineConfig(policy="dense", num_nodes=12, draft_depth=3, verify_costs=curve))
    out = dense.generate(prompts, 20).requests
    assert all(r.verify_tokens == 12 * r.rounds for r in out), "dense keeps EAGLE's full tree"


def test_verify_costs_need_a_draft_price_for_drafting_policies():
    from sglang_graft.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="needs draft_cost_ratio"):
        SchedulerConfig(policy="graft", verify_costs=((1, 1.0), (16, 1.3)))
    SchedulerConfig(policy="retrieval", verify_costs=((1, 1.0), (16, 1.3)))  # nothing to price
    with pytest.raises(ValueError, match="starting at 1 token"):
        SchedulerConfig(policy="retrieval", verify_costs=((4, 1.0), (16, 1.3)))


def test_read_cost_follows_the_draft_kind_and_reaches_the_gate():
    """``EngineConfig.draft_read_cost`` defaults by draft kind (an int8 draft's prefill is
    dearer in its own forwards), an explicit value wins, and the scheduler's
    draft-or-retrieve gate charges what the config says."""
    from sglang_graft.cost import DEFAULT_READ_COST
    from sglang_graft.engine.config import INT8_DRAFT_READ_COST
    from sglang_graft.retrieval import Retriever, RetrieverConfig
    from sglang_graft.scheduler import GraftScheduler

    base = EngineConfig(policy="graft", draft_cost_ratio=0.3)
    assert base.scheduler_config().draft_read_cost == DEFAULT_READ_COST
    int8 = EngineConfig(policy="graft", draft_cost_ratio=0.3, draft_int8=True)
    assert int8.scheduler_config().draft_read_cost == INT8_DRAFT_READ_COST > DEFAULT_READ_COST
    chosen = EngineConfig(policy="graft", draft_cost_ratio=0.3, draft_int8=True, draft_read_cost=0.02)
    scheduler = GraftScheduler(chosen.scheduler_config(), Retriever(RetrieverConfig(vocab_size=100)))
    assert scheduler.draft_gate is not None and scheduler.draft_gate.read_cost == 0.02


@pytest.mark.parametrize("bad", [-0.01, float("nan"), float("inf")])
def test_a_bad_read_cost_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="read cost"):
        EngineConfig(policy="graft", draft_read_cost=bad)


def test_round_cost_prices_verify_width_draft_forwards_and_reads():
    from sglang_graft.cost import RoundCost

    curve = VerifyCost([(1, 100.0), (4, 110.0), (16, 150.0)])
    flat = RoundCost(None, 0.25, 0.05)
    assert flat(1, 1) == 1.0
    assert flat(3, 12) == 1.0  # a flat curve: every verify is one step
    assert flat(1, 12, draft_forwards=3, read_tokens=40) == pytest.approx(1.0 + 0.25 * (3 + 0.05 * 40))
    costed = RoundCost(curve, 0.25, 0.0)
    assert costed(1, 1) == 1.0  # plain decoding: one step per token, whatever the curve
    assert costed(1, 4, draft_forwards=2) == pytest.approx(1.1 + 0.5)
    assert costed(2, 8) == pytest.approx(curve(16) / curve(2))  # read at the batch's token count
    with pytest.raises(ValueError, match="draft_cost_ratio must be a finite number >= 0, got -0.1"):
        RoundCost(None, -0.1, 0.0)
    with pytest.raises(ValueError, match="read cost"):
        RoundCost(None, 0.1, -1.0)


def test_modelled_speedup_counts_what_each_round_spent():
    """Plain decoding is worth exactly 1; ``dense`` (one width every round) costs its
    verify point per round plus the ratio per draft forward and per read token, and the
    first draft reads the prompt (all but its root)."""
    torch.set_num_threads(1)
    target, draft = tiny_models("qwen2", vocab_size=200, seed=1, hidden=32)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    ar = SpecEngine(target, None, EngineConfig(policy="ar")).generate([prompt], 16).requests[0]
    assert ar.model_cost == ar.rounds == len(ar.token_ids)
    curve = ((1, 1.0), (16, 2.0))
    base = dict(policy="dense", num_nodes=4, draft_depth=2, draft_topk=2, draft_cost_ratio=0.3, verify_costs=curve)
    out = SpecEngine(target, draft, EngineConfig(**base, draft_read_cost=0.0)).generate([prompt], 16).requests[0]
    assert out.draft_forwards > 0 and out.rounds < len(out.token_ids), "the draft helped nothing: the test proves nothing"
    assert out.model_cost == pytest.approx(out.rounds * (1.0 + 3 / 15) + 0.3 * out.draft_forwards)
    read = SpecEngine(target, draft, EngineConfig(**base, draft_read_cost=1.0)).generate([prompt], 16).requests[0]
    assert read.token_ids == out.token_ids
    read_tokens = (read.model_cost - out.model_cost) / 0.3
    assert read_tokens >= len(prompt) - 1
    assert read_tokens == pytest.approx(round(read_tokens))
