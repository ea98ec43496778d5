"""``scripts/bench_forward_cost.py``: each timed forward starts from the same cached context,
and the recommended verify budget is the largest one that stays within the slack."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from sglang_graft.engine import tiny_models
from sglang_graft.engine.forward_cost import ForwardTimer, forward_ms, interleaved_ms

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_forward_cost.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_forward_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_forward_ms_times_a_forward_on_a_fixed_context(monkeypatch):
    target, _ = tiny_models("qwen2", vocab_size=100, seed=0, hidden=32)
    lengths: list[int] = []
    original = target.forward

    def spy(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        lengths.append(0 if cache is None else cache.get_seq_length())
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "forward", spy)
    ms = forward_ms(target, context=12, counts=[1, 4], reps=3, vocab=100)
    assert set(ms) == {1, 4} and all(v > 0 for v in ms.values())
    assert lengths == [0] + [12] * 8  # prefill, then warm-up + 3 reps of both counts, each after 12 cached tokens


def test_recommended_num_nodes_is_the_largest_count_within_the_slack():
    recommend = _load().recommended_num_nodes
    measured = {1: 100.0, 2: 95.0, 8: 104.0, 16: 109.0, 24: 130.0, 32: 108.0}
    assert recommend(measured, 1.1) == 32  # a cheap 32 counts even after a dear 24
    assert recommend({**measured, 32: 150.0}, 1.1) == 16
    assert recommend({**measured, 32: 150.0}, 1.05) == 8
    assert recommend({1: 100.0, 2: 180.0, 4: 300.0}, 1.1) == 2  # nothing fits: the smallest tree


def test_verify_costs_flag_parses_back_into_the_measured_curve():
    from sglang_graft.cost import VerifyCost

    measured = {8: 179.4, 1: 156.0, 16: 208.25}
    flag = _load().verify_costs_flag(measured)
    assert flag == "1:156.0,8:179.4,16:208.2"
    cost = VerifyCost.parse(flag)
    assert cost(1) == 1.0 and cost(16) == 208.2 / 156.0


def test_forward_ms_with_a_draft_head_times_the_cut_head():
    from sglang_graft.engine.draft_head import DraftHead

    _, draft = tiny_models("qwen2", vocab_size=100, seed=0, hidden=32)
    head = DraftHead(draft, 10, [], 100)
    shapes: list[tuple[int, ...]] = []

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        shapes.append(tuple(logits.shape))
        return logits

    ms = forward_ms(draft, context=12, counts=[1, 4], reps=2, vocab=100, head=counting)
    assert set(ms) == {1, 4}
    assert shapes == [(1, 1, 10), (1, 4, 10)] * 3  # warm-up + 2 reps, logits over the cut head's 10 kept ids


def test_interleaved_ms_times_both_models_round_robin(monkeypatch):
    """The script times the target and the draft in one loop, so drift hits both alike."""
    target, draft = tiny_models("qwen2", vocab_size=100, seed=0, hidden=32)
    order: list[tuple[str, int]] = []
    timers = {"target": ForwardTimer(target, 12, 100), "draft": ForwardTimer(draft, 12, 100)}
    for name, timer in timers.items():
        original = timer.model.forward

        def spy(*args, _name=name, _original=original, **kwargs):
            order.append((_name, args[0].shape[1]))
            return _original(*args, **kwargs)

        monkeypatch.setattr(timer.model, "forward", spy)
    ms = interleaved_ms(timers, [1, 4], reps=2)
    assert set(ms) == {"target", "draft"} and all(set(v) == {1, 4} for v in ms.values())
    assert order == [("target", 1), ("target", 4), ("draft", 1), ("draft", 4)] * 3


def test_prefill_ms_times_a_fresh_forward_over_the_whole_prompt(monkeypatch):
    from sglang_graft.engine.forward_cost import prefill_ms

    target, _ = tiny_models("qwen2", vocab_size=100, seed=0, hidden=32)
    seen: list[tuple[int, object]] = []
    original = target.forward

    def spy(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append((ids.shape[1], kwargs.get("past_key_values")))
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "forward", spy)
    assert prefill_ms(target, tokens=20, reps=2, vocab=100) > 0
    assert seen == [(20, None)] * 3  # warm-up + 2 reps, each over all 20 tokens, no cache


def test_read_cost_is_the_extra_forwards_per_prompt_token():
    from sglang_graft.engine.forward_cost import read_cost

    # The int8 draft measured in engine.config: 25 ms for 1 token, 830 ms for 700.
    assert read_cost(830.0, 25.0, 700) == (830.0 / 25.0 - 1.0) / 700
    assert read_cost(20.0, 25.0, 700) == 0.0  # a prefill faster than one forward: timing noise


def test_breakdown_charges_each_part_where_its_time_is_spent(monkeypatch):
    """A slowed ``gate_proj`` shows up under ``gate_proj``, not under its MLP block or the
    rest, the parts add up to the forward, and no hook is left behind."""
    import time

    from sglang_graft.engine.forward_cost import breakdown_ms

    target, _ = tiny_models("qwen2", vocab_size=100, seed=0, hidden=32)
    layers = target.model.layers
    for layer in layers:
        gate = layer.mlp.gate_proj
        original = gate.forward

        def slow(x, original=original):
            time.sleep(0.003)
            return original(x)

        monkeypatch.setattr(gate, "forward", slow)
    ms = breakdown_ms(ForwardTimer(target, 12, 100), [1, 4], reps=2)
    linears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for q in (1, 4):
        parts = ms[q]
        assert set(parts) == linears | {"attention", "mlp other", "norms", "lm head", "other", "total"}
        assert parts["gate_proj"] >= 3.0 * len(layers)
        assert parts["mlp other"] < parts["gate_proj"] / 2 and parts["other"] < parts["gate_proj"] / 2
        assert abs(sum(v for k, v in parts.items() if k != "total") - parts["total"]) < 1e-6 * parts["total"] + 1e-9
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in target.modules())
