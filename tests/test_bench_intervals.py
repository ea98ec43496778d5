"""``engine.bench``'s speedups: the paired bootstrap behind the report's intervals, and the
decode speedup that leaves the target's prefill out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.engine.bench import BenchRun, BenchSettings, Record, summarise
from sglang_graft.engine.bench import speedup_interval
from sglang_graft.engine.config import EngineConfig
from sglang_graft.engine.outputs import RequestOutput
from sglang_graft.engine.prompts import Question


def test_ar_against_itself_and_a_uniform_speedup_are_exact():
    ar = [(128, 10.0), (100, 4.0), (64, 7.5)]
    assert speedup_interval(ar, ar) == [1.0, 1.0]
    twice = [(t, s / 2) for t, s in ar]
    assert speedup_interval(twice, ar) == pytest.approx([2.0, 2.0])


def test_one_fast_prompt_widens_the_interval_around_the_point():
    ar = [(100, 10.0)] * 6
    runs = [(100, 10.0)] * 5 + [(100, 2.0)]
    point = (600 / 52.0) / (600 / 60.0)
    low, high = speedup_interval(runs, ar)
    assert 1.0 <= low < point < high <= 5.0
    assert speedup_interval(runs, ar) == [low, high], "the same records must give the same interval"
    narrow = speedup_interval(runs, ar, coverage=0.5)
    assert low <= narrow[0] <= narrow[1] <= high


def test_too_few_prompts_or_unpaired_runs():
    assert speedup_interval([(10, 1.0)], [(10, 2.0)]) is None
    assert speedup_interval([], []) is None
    with pytest.raises(ValueError, match="2 runs against 1 ar runs"):
        speedup_interval([(1, 1.0), (1, 1.0)], [(1, 1.0)])
    with pytest.raises(ValueError, match=r"coverage must be in \(0, 1\), got 1.0"):
        speedup_interval([(1, 1.0), (1, 1.0)], [(1, 1.0), (1, 1.0)], coverage=1.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 200), st.floats(0.1, 50.0), st.floats(0.1, 50.0)), min_size=2, max_size=8
    )
)
def test_lossless_runs_stay_within_the_per_prompt_speedups(rows):
    """Where a method emits what ``ar`` emits (a lossless policy), every resample's speedup
    is a ratio of summed times, so it lies between the smallest and largest prompt's."""
    runs = [(tokens, seconds) for tokens, seconds, _ in rows]
    ar = [(tokens, ar_seconds) for tokens, _, ar_seconds in rows]
    per_prompt = [a / s for (_, s), (_, a) in zip(runs, ar)]
    low, high = speedup_interval(runs, ar, resamples=200)
    assert min(per_prompt) * (1 - 1e-9) <= low <= high <= max(per_prompt) * (1 + 1e-9)


def _record(qid: str, category: str, tokens: int, seconds: float, prefill: float) -> Record:
    out = RequestOutput(token_ids=list(range(tokens)), rounds=tokens, prefill_s=prefill)
    return Record(Question(qid, category, "text"), out, seconds)


def test_decode_speedup_leaves_the_prefill_out():
    """A long prompt's prefill, alike for both methods, hides a 2x faster decode: the
    overall speedup is 1.33x, the decode speedup 2x, per category and overall."""
    settings = BenchSettings(("ar", "graft"), 100, EngineConfig(), 0.5)
    run = BenchRun(settings, {
        "ar": [_record("1", "rag", 100, 20.0, 10.0), _record("2", "qa", 50, 6.0, 1.0)],
        "graft": [_record("1", "rag", 100, 15.0, 10.0), _record("2", "qa", 50, 3.5, 1.0)],
    })
    pol = summarise(run, {})["policies"]
    rag, qa, overall = (pol["graft"]["categories"]["rag"], pol["graft"]["categories"]["qa"], pol["graft"]["overall"])
    assert rag["speedup_vs_ar"] == pytest.approx(20.0 / 15.0)
    assert rag["decode_speedup_vs_ar"] == pytest.approx(2.0)
    assert qa["decode_speedup_vs_ar"] == pytest.approx(5.0 / 2.5)
    assert overall["prefill_seconds"] == pytest.approx(11.0)
    assert overall["decode_tokens_per_s"] == pytest.approx(150 / 7.5)
    assert overall["decode_speedup_vs_ar"] == pytest.approx((150 / 7.5) / (150 / 15.0))
    assert pol["ar"]["overall"]["decode_speedup_vs_ar"] == pytest.approx(1.0)
    assert [r["prefill_seconds"] for r in pol["graft"]["prompts"]] == [10.0, 1.0]
