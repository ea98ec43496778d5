"""``scripts/bench_forward_cost.py``: each timed forward starts from the same cached context."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from sglang_graft.engine import tiny_models

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
    ms = _load().forward_ms(target, context=12, new_tokens=4, reps=3, vocab=100)
    assert ms > 0
    assert lengths == [0, 12, 12, 12, 12]  # prefill, then warm-up + 3 reps each after 12 cached tokens
