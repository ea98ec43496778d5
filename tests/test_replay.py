"""Replaying recorded greedy outputs through retrieval (``sglang_graft.retrieval.replay``)
and the script around it (tiny model, on the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_graft.cost import VerifyCost
from sglang_graft.engine.config import EngineConfig
from sglang_graft.engine.decoder import SpecEngine
from sglang_graft.engine.models import prepare_pair
from sglang_graft.engine.prompts import encode_prompt
from sglang_graft.retrieval import RetrieverConfig
from sglang_graft.retrieval.replay import Recording, accepted_path, replay_prompt_lookup, replay_retrieval
from sglang_graft.scheduler import SchedulerConfig

CURVE = VerifyCost(((1, 1.0), (4, 1.1), (8, 1.3), (16, 1.6)))


def _rec(prompt: list[int], output: list[int], category: str = "c") -> Recording:
    return Recording(category, prompt, output, [[t, (t + 1) % 50] for t in output])


def test_accepted_path_follows_the_matching_children():
    # root -> 1 -> 2 -> 3, and root -> 1 -> 4, root -> 5
    tokens, parents = [0, 1, 5, 2, 4, 3], [-1, 0, 0, 1, 1, 3]
    assert accepted_path(tokens, parents, [1, 2, 3, 9]) == [1, 3, 5]
    assert accepted_path(tokens, parents, [1, 4]) == [1, 4]
    assert accepted_path(tokens, parents, [7]) == []


def test_prompt_lookup_takes_the_earliest_match_and_falls_back_to_one_token():
    # "9 1" occurs nowhere before; "1" first occurs at index 1, followed by 2 3 4 9 1.
    rec = _rec([5, 1, 2, 3, 4, 9, 1], [2, 3, 4, 7])
    out = replay_prompt_lookup(rec, CURVE)
    assert (out.tokens, out.rounds, out.verified) == (4, 1, 6)
    assert out.cost == pytest.approx(CURVE(6))
    cut = replay_prompt_lookup(rec, CURVE, stop_ids={9})  # the chain stops before a stop token
    assert (cut.tokens, cut.rounds, cut.verified) == (4, 1, 4)
    fresh = replay_prompt_lookup(_rec([1, 2], [3, 4]), CURVE)  # nothing ever matches
    assert (fresh.tokens, fresh.rounds, fresh.verified) == (2, 2, 2)


def test_retrieval_replay_emits_every_output_token_and_copies_a_quote():
    quote = [10, 11, 12, 13, 14, 15, 16, 17]
    recs = [_rec([1, *quote, 2, 3], [10, *quote[1:], 4], "copy"), _rec([5, 6, 7], [8, 9, 20, 21], "fresh")]
    sched = SchedulerConfig(policy="retrieval", num_nodes=8)
    results = replay_retrieval(recs, RetrieverConfig(vocab_size=50), sched)
    assert [r.tokens for r in results] == [9, 4]
    assert [r.category for r in results] == ["copy", "fresh"]
    assert results[0].rounds <= 3  # "10" starts the quote, which is then copied whole
    assert all(r.verified == 8 * r.rounds for r in results)  # no verify costs: full width
    off = RetrieverConfig(vocab_size=50, recycling=False, context=False, history=False)
    assert [r.rounds for r in replay_retrieval(recs, off, sched)] == [9, 4]  # nothing proposed: tau 1


def test_bad_recordings_and_policies_are_named():
    with pytest.raises(ValueError, match="one top-k row per output token"):
        Recording("c", [1], [2, 3], [[2]])
    with pytest.raises(ValueError, match="must start with the greedy output token 3"):
        Recording("c", [1], [2, 3], [[2], [4, 3]])
    with pytest.raises(ValueError, match="prompt of at least one token"):
        Recording("c", [], [], [])
    with pytest.raises(ValueError, match="only the retrieval policy"):
        replay_retrieval([], RetrieverConfig(vocab_size=8), SchedulerConfig(policy="graft"))


def test_script_records_a_tiny_model_and_replays_it(tmp_path):
    questions = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "rag", "turns": ["The cat sat. The cat sat. The cat"]},
        {"question_id": 2, "category": "coding", "turns": ["def add(a, b):"]},
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = str(Path(__file__).resolve().parent.parent / "scripts" / "replay_retrieval.py")
    out = tmp_path / "rec.json"
    run = subprocess.run(
        [sys.executable, script, "record", "--target", "tiny", "--questions", str(questions),
         "--max-new-tokens", "6", "--dtype", "float32", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert [r["category"] for r in data["recordings"]] == ["rag", "mt_bench"]  # coding is an MT-bench category
    pair = prepare_pair("tiny", None, dtype="float32")
    engine = SpecEngine(pair.target, None, EngineConfig(policy="ar"), stop_token_ids=pair.stop_token_ids)
    for r, row in zip(data["recordings"], rows):
        assert 1 <= len(r["output"]) <= 6 and [top[0] for top in r["topk"]] == r["output"]
        assert r["prompt"] == encode_prompt(pair.tokenizer, row["turns"][0])
        assert engine.generate([r["prompt"]], 6).requests[0].token_ids == r["output"]  # what --policy ar writes
    run = subprocess.run(
        [sys.executable, script, "replay", str(out), "--verify-costs", "1:1,8:1.2", "--num-nodes", "8"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for method in ("retrieval", "prompt lookup"):
        assert any(line.startswith(method) and "overall" in line for line in lines)
    bad = subprocess.run([sys.executable, script, "replay", str(out), "--verify-costs", "8:1"], capture_output=True, text=True)
    assert bad.returncode != 0 and "starting at 1 token" in bad.stderr
