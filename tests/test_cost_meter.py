"""The online cost meter: fits of timed rounds, the priors that hold until data decide,
the scheduler it re-prices, and the engine that feeds it (lossless whatever it learns)."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import TEST_DEVICE
from sglang_graft.cost import VerifyCost
from sglang_graft.cost_meter import CostMeter
from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models
from sglang_graft.scheduler import GraftScheduler, SchedulerConfig

STEEP = VerifyCost(((1, 74.0), (4, 87.0), (12, 115.0)))


def _meter(curve: VerifyCost = STEEP, ratio: float = 0.3, read_cost: float = 0.05, **kw) -> CostMeter:
    return CostMeter(curve, ratio, read_cost, num_nodes=12, **kw)


def test_until_enough_rounds_are_timed_the_configured_costs_stand():
    meter = _meter()
    assert meter.verify_cost() is STEEP and meter.draft_cost_ratio() == 0.3
    for _ in range(3):  # decayed weight 2.94 < min_weight 4
        meter.observe_verify(8, 0.1)
        meter.observe_draft(3, 2, 0.06)
    assert meter.step_seconds() is None
    assert meter.verify_cost() is STEEP and meter.draft_cost_ratio() == 0.3
    assert meter.flags() == "--verify-costs 1:74,4:87,12:115 --draft-cost-ratio 0.300"  # as configured


def test_verify_fit_recovers_an_affine_host_and_follows_its_phase():
    meter = _meter()
    for _ in range(20):
        for w in (2, 5, 9, 12):
            meter.observe_verify(w, 0.070 + 0.004 * w)
    assert meter.step_seconds() == pytest.approx(0.074, rel=0.01)
    assert meter.verify_cost()(12) == pytest.approx(0.118 / 0.074, rel=0.01)
    # The host turns slow and flat: 90 ms a step, 12 tokens 1.14x. Some 200 rounds later
    # (about 20 s of rounds) the old phase has faded out.
    for _ in range(50):
        for w in (2, 5, 9, 12):
            meter.observe_verify(w, 0.0888 + 0.0012 * w)
    assert meter.step_seconds() == pytest.approx(0.090, rel=0.01)
    assert meter.verify_cost()(12) == pytest.approx(0.1032 / 0.090, rel=0.01)
    step = meter.step_seconds() * 1e3
    assert meter.flags().startswith(f"--verify-costs 1:{step:.1f},12:{step * meter.verify_cost()(12):.1f} ")


def test_rounds_at_one_width_keep_the_configured_shape_and_learn_the_level():
    meter = _meter()
    for _ in range(40):
        meter.observe_verify(6, 0.2)
    curve = meter.verify_cost()
    assert curve(12) == pytest.approx(STEEP(12), rel=1e-3)  # the shape nothing contradicted
    shape_at_6 = 1.0 + (STEEP(12) - 1.0) * 5 / 11
    assert meter.step_seconds() == pytest.approx(0.2 / shape_at_6, rel=1e-3)


def test_a_fit_that_prices_one_token_at_nothing_falls_back_to_the_configured_curve():
    meter = _meter()
    for _ in range(20):
        for w in (8, 12):  # 12 tokens cost 3x 8: an intercept below zero
            meter.observe_verify(w, 0.05 * (w - 6))
    assert meter.step_seconds() is None and meter.verify_cost() is STEEP


def _timed_steps(meter: CostMeter, step: float = 0.074) -> None:
    """Verifies of a host on the configured curve's line (``step`` seconds for one token)."""
    for _ in range(10):
        for w in (2, 8, 12):
            meter.observe_verify(w, step * (1.0 + (STEEP(12) - 1.0) * (w - 1) / 11))


def test_draft_fit_learns_the_ratio_and_counts_short_reads_at_the_configured_read_cost():
    meter = _meter(ratio=0.5, read_cost=0.05)
    _timed_steps(meter)
    assert meter.step_seconds() == pytest.approx(0.074, rel=1e-6)
    forward = 0.018
    for i in range(30):
        forwards, read = 1 + i % 4, i % 3
        meter.observe_draft(forwards, read, forward * (forwards + 0.05 * read))
    assert meter.draft_cost_ratio() == pytest.approx(forward / 0.074, rel=1e-6)
    assert meter.flags().endswith(f" --draft-cost-ratio {forward / 0.074:.3f}")


def test_long_reads_and_stalls_do_not_lock_the_draft_out():
    # A benchmark's first draft calls ran slow and long reads came out at 0.27 forwards a
    # token; learned, that price stopped every later read. Reads are left out of the fit,
    # and a stall counts as at most ``outlier`` times the prediction.
    meter = _meter(ratio=0.5, read_cost=0.05)
    _timed_steps(meter)
    for i in range(20):
        meter.observe_draft(1 + i % 4, 1, 0.018 * (1 + i % 4 + 0.05))
    meter.observe_draft(1, 600, 5.0)  # a 600-token read that took 5 s: not a forward's price
    ratio = 0.018 / 0.074
    assert meter.draft_cost_ratio() == pytest.approx(ratio, rel=1e-6)
    meter.observe_draft(2, 0, 30.0)  # a 30 s stall of the host (unclipped: the ratio x39)
    assert 1.0 < meter.draft_cost_ratio() / ratio < 1.2
    for _ in range(100):  # the decay washes it out
        meter.observe_draft(2, 0, 0.036)
    assert meter.draft_cost_ratio() == pytest.approx(ratio, rel=0.01)
    meter.observe_verify(8, 60.0)  # a stalled verify, clipped likewise (unclipped: the step x28)
    assert 1.0 < meter.step_seconds() / 0.074 < 1.2


@settings(max_examples=60, deadline=None)
@given(
    a=st.floats(0.001, 1.0),
    b_over_a=st.floats(0.0, 0.5),
    widths=st.lists(st.integers(1, 64), min_size=2, max_size=20).filter(lambda w: len(set(w)) >= 2),
)
def test_exact_timings_of_the_configured_shape_are_recovered_exactly(a, b_over_a, widths):
    # A prior shape equal to the host's costs the fit nothing: a and b come back exactly.
    curve = VerifyCost(((1, 1.0), (12, 1.0 + 11 * b_over_a / (1 + b_over_a))))
    meter = CostMeter(curve, 0.3, 0.05, num_nodes=12, min_weight=1.0)
    for w in widths:
        meter.observe_verify(w, a + a * b_over_a * w)
    assert meter.step_seconds() == pytest.approx(a * (1 + b_over_a), rel=1e-6)
    assert meter.verify_cost()(12) == pytest.approx(curve(12), rel=1e-6)


def test_bad_settings_and_bad_timings_are_refused_or_ignored():
    with pytest.raises(ValueError, match="draft_cost_ratio"):
        CostMeter(STEEP, 0.0, 0.05, 12)
    with pytest.raises(ValueError, match="read cost"):
        CostMeter(STEEP, 0.3, -1.0, 12)
    with pytest.raises(ValueError, match="num_nodes"):
        CostMeter(STEEP, 0.3, 0.05, 1)
    with pytest.raises(ValueError, match="decay must be in"):
        CostMeter(STEEP, 0.3, 0.05, 12, decay=1.0)
    with pytest.raises(ValueError, match="outlier must be > 1"):
        CostMeter(STEEP, 0.3, 0.05, 12, outlier=1.0)
    meter = _meter(min_weight=1.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        meter.observe_verify(4, bad)
        meter.observe_draft(2, 0, bad)
    meter.observe_verify(0, 0.1)
    meter.observe_draft(0, 10, 0.1)
    assert meter.verify_cost() is STEEP and meter.draft_cost_ratio() == 0.3


def test_set_costs_reprices_every_choice_of_the_scheduler():
    config = SchedulerConfig(policy="graft", num_nodes=8, draft_cost_ratio=0.3, draft_depth=4, verify_costs=STEEP.points)

    class NoRetrieval:
        def propose(self, rids, budget): ...
        def propose_below(self, rids, tree, anchors): ...
        def observe(self, *args, **kwargs): ...

    scheduler = GraftScheduler(config, NoRetrieval())
    flat = VerifyCost(((1, 1.0), (8, 1.0)))
    read_cost = scheduler.draft_gate.read_cost
    scheduler.set_costs(flat, 0.2)
    assert scheduler.verify_cost is flat
    assert scheduler.rate.ratio == scheduler.depth_budget.ratio == scheduler.draft_gate.ratio == 0.2
    assert scheduler.draft_gate.read_cost == read_cost  # in draft forwards: it follows the ratio
    # A flat curve verifies every node that may be accepted; the steep one keeps fewer.
    scores = torch.tensor([[1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02]], dtype=torch.float64)
    assert flat.best_width(scores, 1.0) == 8 > STEEP.best_width(scores, 1.0)
    with pytest.raises(ValueError, match="draft_cost_ratio"):
        scheduler.set_costs(flat, -1.0)
    dense = GraftScheduler(SchedulerConfig(policy="dense", num_nodes=8, verify_costs=STEEP.points))
    with pytest.raises(ValueError, match="prices no verify width"):
        dense.set_costs(flat, 0.2)


def test_online_costs_keep_every_policy_lossless_and_learn_from_the_run(caplog):
    torch.set_num_threads(1)
    target, draft = (m.to(TEST_DEVICE) for m in tiny_models("qwen2", vocab_size=200, seed=1, hidden=32))
    prompts = [[11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15, 16, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6]]
    ref = SpecEngine(target, None, EngineConfig(policy="ar")).generate(prompts, 24)
    caplog.set_level(logging.INFO, logger="sglang_graft")
    common = dict(num_nodes=8, draft_depth=3, draft_topk=3, draft_cost_ratio=0.3, verify_costs=((1, 1.0), (8, 1.3)))
    for policy in ("pruned", "retrieval", "graft"):
        engine = SpecEngine(target, draft, EngineConfig(policy=policy, online_costs=True, **common))
        assert engine.meter is not None
        for _ in range(2):
            out = engine.generate(prompts, 24)
            assert [r.token_ids for r in out.requests] == [r.token_ids for r in ref.requests], policy
        assert engine.meter.step_seconds() is not None, f"{policy}: no verify was timed"
        assert engine.scheduler.verify_cost is not engine.round_cost.verify  # re-priced; the report's model stays
    assert any("graft: online costs after this batch: --verify-costs 1:" in r.getMessage() for r in caplog.records)
    assert SpecEngine(target, draft, EngineConfig(policy="dense", online_costs=True, **common)).meter is None
    with pytest.raises(ValueError, match="online_costs needs verify_costs"):
        SpecEngine(target, draft, EngineConfig(policy="graft", online_costs=True, num_nodes=8, draft_cost_ratio=0.3))
