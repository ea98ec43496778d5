"""The ``sglang-graft`` command: help, generate (text, JSON, errors) and bench on tiny models."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from sglang_graft.cli import main

TINY = ["--target", "tiny", "--draft", "tiny"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _json_line(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_help_shows_the_next_step():
    proc = subprocess.run([sys.executable, "-m", "sglang_graft.cli", "generate", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "--target tiny --draft tiny" in proc.stdout
    assert "sglang-graft bench --help" in proc.stdout
    for cmd in ("bench", "serve"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0


def test_generate_json_is_lossless_across_policies(capsys):
    ids = {}
    for policy in ("ar", "dense", "graft", "retrieval"):
        rc = main(["generate", *TINY, "--policy", policy, "--prompt", "abcabcabc", "--max-new-tokens", "24", "--json"])
        assert rc == 0
        out = capsys.readouterr().out
        record = _json_line(out)
        assert record["policy"] == policy
        assert {"token_ids", "text", "tau", "tokens_per_s"} <= record.keys()
        assert len(record["token_ids"]) == 24 and record["tokens_per_s"] > 0
        assert f"[{policy}] tau=" in out
        ids[policy] = record["token_ids"]
    assert ids["dense"] == ids["ar"] == ids["graft"] == ids["retrieval"]


def test_generate_batch_from_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond\n" + json.dumps({"prompt": "third one"}) + "\n")
    rc = main(["generate", *TINY, "--prompts", str(prompts), "--max-new-tokens", "6", "--json",
               "--temperature", "0.8", "--seed", "3"])
    assert rc == 0
    record = _json_line(capsys.readouterr().out)
    assert len(record["token_ids"]) == 3 and all(len(t) == 6 for t in record["token_ids"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-nodes", "1"], "num_nodes (verify budget n) must be >= 2, got 1"),
        (["--policy", "dense", "--draft", "/no/such/dir"], "--draft '/no/such/dir': not a directory"),
        (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--max-new-tokens", "5000"], "positions of the target model, whose context window is 4096"),
    ],
)
def test_generate_errors(argv, message, capsys):
    base = ["generate", "--target", "tiny", "--draft", "tiny", "--prompt", "x"]
    if "--draft" in argv:
        base = ["generate", "--target", "tiny", "--prompt", "x"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_verify_costs_auto_is_measured_on_the_target_and_lossless(capsys, caplog):
    caplog.set_level(logging.INFO, logger="sglang_graft")
    common = [*TINY, "--prompt", "abcabcabc", "--max-new-tokens", "16", "--num-nodes", "8", "--json"]
    assert main(["generate", *common, "--policy", "ar"]) == 0
    ar = _json_line(capsys.readouterr().out)
    assert main(["generate", *common, "--policy", "graft", "--verify-costs", "auto"]) == 0
    graft = _json_line(capsys.readouterr().out)
    assert graft["token_ids"] == ar["token_ids"]
    assert 2 <= graft["verify_tokens_per_round"] <= 8
    logged = [r.getMessage() for r in caplog.records if "verify costs measured" in r.getMessage()]
    assert len(logged) == 1 and "--verify-costs 1:" in logged[0] and ",8:" in logged[0]


def test_online_costs_learn_from_the_run_and_stay_lossless(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="sglang_graft")
    common = [*TINY, "--prompt", "abcabcabc", "--max-new-tokens", "16", "--num-nodes", "8", "--json"]
    assert main(["generate", *common, "--policy", "ar"]) == 0
    ar = _json_line(capsys.readouterr().out)
    assert main(["generate", *common, "--policy", "graft", "--verify-costs", "auto", "--online-costs"]) == 0
    assert _json_line(capsys.readouterr().out)["token_ids"] == ar["token_ids"]
    assert any("graft: online costs after this batch: --verify-costs 1:" in r.getMessage() for r in caplog.records)
    assert not any("prices the draft by its weights" in r.getMessage() for r in caplog.records)
    assert main(["generate", *common, "--policy", "graft", "--verify-costs", "auto"]) == 0
    assert any("add --online-costs to learn it" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    assert main(["generate", *common, "--policy", "graft", "--online-costs"]) == 2
    assert "--online-costs learns from a starting verify curve: add --verify-costs auto" in capsys.readouterr().err
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "rag", "turns": ["The cat sat. The cat sat."]}) + "\n")
    out = tmp_path / "out"
    assert main(["bench", *TINY, "--questions", str(questions), "--policies", "ar,dense,graft", "--max-new-tokens", "10",
                 "--verify-costs", "1:1,8:1.2", "--online-costs", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["online_costs"] is True
    assert set(results["learned_costs"]) == {"graft"}  # dense never trims, ar has no scheduler
    assert results["learned_costs"]["graft"].startswith("--verify-costs 1:")
    assert results["policies"]["graft"]["overall"]["identical_to_ar"] == 1.0
    md = (out / "results.md").read_text()
    assert "verify costs `1:1,8:1.2`, draft cost ratio from the weights, read cost " in md and ", learned online;" in md
    assert f"- graft: `{results['learned_costs']['graft']}`" in md


def test_verify_costs_flag_errors_name_the_problem(capsys):
    for bad, message in (("2:1,8:2", "starting at 1 token"), ("1:1,8", "tokens:cost pairs"), ("1:1,4:-2", "> 0")):
        with pytest.raises(SystemExit) as exc:
            main(["generate", *TINY, "--prompt", "x", "--verify-costs", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--verify-costs:" in err and message in err


def test_generate_needs_a_draft_for_draft_policies(capsys):
    assert main(["generate", "--target", "tiny", "--prompt", "x", "--policy", "graft"]) == 2
    assert "needs --draft" in capsys.readouterr().err
    assert main(["generate", "--target", "tiny", "--prompt", "x", "--policy", "ar", "--max-new-tokens", "3"]) == 0


def test_bench_writes_results(tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a poem about the sea."]},
        {"question_id": 2, "category": "coding", "turns": ["def add(a, b):"]},
        {"question_id": 3, "category": "rag", "turns": ["The cat sat. The cat sat. The cat"]},
        {"question_id": 4, "category": "rag", "turns": ["skipped by --per-category 1"]},
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    policies = "ar,dense,pruned,retrieval,graft,hf-assisted,hf-pld"
    rc = main(["bench", *TINY, "--questions", str(questions), "--policies", policies, "--per-category", "1",
               "--max-new-tokens", "10", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["policies"]) == set(policies.split(","))
    assert (results["meta"]["prompts_done"], results["meta"]["prompts"], results["meta"]["complete"]) == (2, 2, True)
    for name, p in results["policies"].items():
        assert set(p["categories"]) == {"mt_bench", "rag"}
        o = p["overall"]
        for key in ("tau", "draft_forwards_per_round", "verify_tokens_per_round", "tokens_per_s",
                    "speedup_vs_ar", "accepted_share_by_source", "identical_to_ar", "divergences"):
            assert key in o
        assert o["prompts"] == 2
        assert len(o["speedup_interval"]) == 2 and o["speedup_interval"][0] <= o["speedup_interval"][1]
        assert [(r["question_id"], r["tokens"] > 0, r["seconds"] > 0) for r in p["prompts"]] == [
            ("1", True, True),
            ("3", True, True),
        ]
        # Every method times its target prefill (transformers': the first target forward).
        assert all(0 < r["prefill_seconds"] < r["seconds"] for r in p["prompts"]), (name, p["prompts"])
        assert o["decode_tokens_per_s"] > o["tokens_per_s"] and o["decode_speedup_vs_ar"] > 0
        if name in ("dense", "pruned", "retrieval", "graft"):
            assert o["identical_to_ar"] == 1.0 and o["divergences"] == []
    assert results["policies"]["ar"]["overall"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert results["policies"]["ar"]["overall"]["decode_speedup_vs_ar"] == pytest.approx(1.0)
    assert results["policies"]["ar"]["overall"]["tau"] == pytest.approx(1.0)
    assert results["policies"]["retrieval"]["overall"]["draft_forwards_per_round"] == 0
    assert results["policies"]["hf-assisted"]["overall"]["draft_forwards_per_round"] > 0
    # Modelled decode time: plain decoding is worth 1 by construction; transformers'
    # baselines are not modelled.
    assert results["policies"]["ar"]["overall"]["modelled_speedup"] == pytest.approx(1.0)
    assert results["policies"]["graft"]["overall"]["modelled_speedup"] > 0
    assert results["policies"]["hf-pld"]["overall"]["modelled_speedup"] is None
    md = (out / "results.md").read_text()
    assert "| graft |" in md and "Modelled speedup" in md and "Decode speedup over `ar` per category" in md and "every round verifies all n;" in md
    assert "| 90% interval |" in md and "90% intervals of the speedup over `ar` per category" not in md  # 1 a category
    assert "learned online" not in md and "Partial" not in md
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_questions_by_category(tmp_path):
    from sglang_graft.engine.prompts import load_questions

    q = tmp_path / "q.jsonl"
    rows = [("writing", "a"), ("summarization", "b"), ("coding", "c"), ("qa", "d"), ("summarization", "e")]
    q.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in enumerate(rows)))
    picked = load_questions(str(q), per_category=1, categories=["summarization", "mt_bench"])
    assert [(x.category, x.text) for x in picked] == [("mt_bench", "a"), ("summarization", "b")]
    with pytest.raises(ValueError, match=r"no category \['rag'\]; it holds \['mt_bench', 'summarization', 'qa'\]"):
        load_questions(str(q), categories=["qa", "rag"])
    with pytest.raises(ValueError, match="names no category"):
        load_questions(str(q), categories=[])


def test_bench_checks_every_prompt_fits_before_the_first_run(tmp_path, capsys, monkeypatch):
    from sglang_graft.engine import bench

    monkeypatch.setattr(bench._Method, "run", lambda *a: pytest.fail("a method ran before the prompts were checked"))
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
                         for i, t in enumerate(["hi", "x" * 300])))
    rc = main(["bench", *TINY, "--questions", str(q), "--policies", "ar,graft", "--per-category", "2",
               "--max-new-tokens", "3900", "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "prompt 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bench_rejects_unknown_policy_before_loading(tmp_path, capsys):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}) + "\n")
    rc = main(["bench", "--target", "/nowhere", "--questions", str(q), "--policies", "ar,eagle9", "--out", str(tmp_path)])
    assert rc == 2
    assert "unknown policies ['eagle9']" in capsys.readouterr().err


def test_bench_interrupted_keeps_the_finished_prompts(tmp_path, capsys, monkeypatch):
    """Ctrl-C during the second prompt: the first prompt's results stay on disk, marked partial."""
    from sglang_graft.engine import bench

    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [t]}
            for i, (c, t) in enumerate([("writing", "Write a poem."), ("coding", "def add(a, b):")])]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = bench._Method.run
    calls = []

    def interrupt_at_the_second_prompt(self, prompt, max_new_tokens):
        calls.append(self.name)
        if len(calls) == 2 + 2 + 1:  # warm-up of both methods, prompt 1, then prompt 2's first run
            raise KeyboardInterrupt
        return run(self, prompt, max_new_tokens)

    monkeypatch.setattr(bench._Method, "run", interrupt_at_the_second_prompt)
    out = tmp_path / "out"
    argv = ["bench", *TINY, "--questions", str(questions), "--policies", "ar,graft", "--max-new-tokens", "6",
            "--out", str(out)]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "1 of 2 prompts" in err
    results = json.loads((out / "results.json").read_text())
    meta = results["meta"]
    assert (meta["prompts_done"], meta["prompts"], meta["complete"]) == (1, 2, False)
    for p in results["policies"].values():
        assert p["overall"]["prompts"] == 1
    assert results["policies"]["graft"]["overall"]["identical_to_ar"] == 1.0
    assert "**Partial results**: 1 of 2 prompts" in (out / "results.md").read_text()
    assert not (out / "pareto.png").exists()
    assert sorted(os.listdir(out)) == ["results.json", "results.md"]  # no temporary files left

    # Interrupted before any prompt finished: nothing is written, and the message says so.
    calls.clear()
    monkeypatch.setattr(bench._Method, "run", lambda self, p, n: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main([*argv[:-1], str(tmp_path / "none")]) == 130
    assert "nothing written" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
