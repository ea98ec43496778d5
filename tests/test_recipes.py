"""Deployment recipes: the Qwen3-235B launch line and the GPU benchmark's CPU-side logic.

The launch recipe's flags are read back from the script itself (``--print-args``) and
checked against the real, pinned SGLang ``ServerArgs`` with the plugin registered: every
flag spelled in full and known to SGLang's parser (plus Graft's ``--graft-*`` flags), the
values parsed, and SGLang's resolution pipeline run, which includes Graft's startup checks
(``resolve_graft_launch``). The target and draft are replaced by local ``config.json``
stand-ins with the published Qwen3-235B-A22B and EAGLE-3 head shapes (no weights, no
download) and ``--device cpu`` is added, since SGLang's device auto-detection needs an
accelerator. What this cannot check without GPUs: weight loading and memory fit, CUDA
graph capture, and device-derived defaults (on CPU the attention backend resolves to
torch_native; on Hopper/Blackwell with top-k > 1 it resolves to FlashInfer).

The benchmark script cannot run here; its pure parts (arguments, prompt split, launch
lines, summaries, tables, host refusal) are tested with fakes, and its launch lines go
through the same ``ServerArgs`` resolution as the recipe.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sglang_graft.serve import ServeUnavailable, serve_command

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "scripts" / "launch_qwen3_235b.sh"
BENCH = ROOT / "scripts" / "bench_sglang_gpu.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_sglang_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


# ---------------------------------------------------------------- the launch recipe


def recipe_args(*extra: str, **env: str) -> list[str]:
    """The argument list the recipe hands to ``sglang-graft serve``, from ``--print-args``,
    with the caller's environment minus any ``GRAFT_*`` settings plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    run = subprocess.run(
        ["bash", str(RECIPE), "--print-args", *extra], capture_output=True, text=True, env={**base, **env}, check=True
    )
    return run.stdout.splitlines()


def value_of(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """Config-only stand-ins for the target and draft, shaped like the published
    checkpoints (what SGLang's launch resolution reads: architecture, heads, layers,
    positions, vocabulary)."""
    root = tmp_path_factory.mktemp("qwen3_235b")
    target = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "max_position_embeddings": 40960, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    draft = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 24576, "num_hidden_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 4,
        "head_dim": 128, "max_position_embeddings": 40960, "vocab_size": 151936, "draft_vocab_size": 32000,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    paths = {}
    for name, config in (("target", target), ("draft", draft)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        paths[name] = str(root / name)
    return paths


@pytest.fixture(scope="module")
def sglang_server_args():
    """SGLang's ``server_args`` module with Graft registered (imported once: ~15 s)."""
    pytest.importorskip("sglang.srt.plugins")
    from sglang.srt import server_args

    from sglang_graft.sglang import plugin

    plugin.register()
    return server_args


def _resolve(server_args_module, argv: list[str]):
    """``ServerArgs`` for ``argv`` on this CPU host, resolved as a launch would be."""
    from sglang.srt.arg_groups.overrides import resolved_view

    sa = server_args_module.prepare_server_args([*argv, "--device", "cpu"])
    sa.resolve_once()
    return sa, resolved_view(sa)


def test_recipe_names_the_published_checkpoints_and_passes_arguments_through():
    args = recipe_args()
    assert value_of(args, "--model-path") == "Qwen/Qwen3-235B-A22B"
    assert value_of(args, "--speculative-draft-model-path") == "lmsys/Qwen3-235B-A22B-EAGLE3"
    assert value_of(args, "--speculative-algorithm") == "GRAFT"
    assert value_of(args, "--tp-size") == "8"
    assert (value_of(args, "--host"), value_of(args, "--port")) == ("0.0.0.0", "30000")
    moved = recipe_args("--graft-policy", "pruned", GRAFT_HOST="127.0.0.1", GRAFT_PORT="31234")
    assert (value_of(moved, "--host"), value_of(moved, "--port")) == ("127.0.0.1", "31234")
    # Extra arguments come after the recipe's (SGLang keeps the last value) and
    # --print-args itself is not passed on.
    assert moved[-2:] == ["--graft-policy", "pruned"] and "--print-args" not in moved


def test_recipe_spells_out_every_graft_default():
    args = recipe_args()
    cmd = serve_command(args)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[3:] == args  # serve adds nothing: the recipe states every setting it relies on


def test_every_recipe_flag_is_a_full_sglang_or_graft_flag(sglang_server_args):
    # allow_abbrev=False: a flag that only works as a prefix of a longer option (as
    # --cuda-graph-max-bs once did) would break when SGLang adds a similar option.
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    sglang_server_args.ServerArgs.add_cli_args(parser)  # the plugin's hook adds --graft-*
    known = {opt for action in parser._actions for opt in action.option_strings}
    args = recipe_args()
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    assert flags and [f for f in flags if f not in known] == []
    ns, rest = parser.parse_known_args(args)
    assert rest == []
    assert ns.tp_size == 8 and ns.speculative_eagle_topk == 4 and ns.speculative_num_draft_tokens == 16
    assert ns.mem_fraction_static == 0.85 and ns.cuda_graph_max_bs_decode == 32


def test_recipe_resolves_to_a_graft_launch_that_graft_accepts(sglang_server_args, stand_ins):
    from sglang_graft.sglang.server_args_hooks import check_graft_launch

    args = recipe_args(GRAFT_MODEL_PATH=stand_ins["target"], GRAFT_DRAFT_PATH=stand_ins["draft"])
    sa, view = _resolve(sglang_server_args, args)
    assert view.speculative_algorithm == "GRAFT" and bench.reported_algorithm(sa.resolved_dict()) == "GRAFT"
    assert view.tp_size == 8
    assert view.speculative_eagle_topk > 1 and view.speculative_num_draft_tokens >= 2
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (5, 4, 16)
    assert view.disable_overlap_schedule and view.context_length == 32768
    assert view.max_running_requests == 32 == view.cuda_graph_max_bs_decode
    assert view.speculative_draft_model_path == stand_ins["draft"]
    check_graft_launch(view)  # resolve_once ran it already; state the acceptance explicitly
    s = sa._graft_settings
    assert s.policy == "graft" and s.sources == ("recycling", "context", "history")
    assert s.history_max_tokens == 4194304 and s.log_interval == 200
    # The same line with top-k 1 appended is refused: Graft's startup checks are live here.
    sa1 = sglang_server_args.prepare_server_args([*args, "--speculative-eagle-topk", "1", "--device", "cpu"])
    with pytest.raises(ValueError, match=r"needs --speculative-eagle-topk > 1 \(got 1\)"):
        sa1.resolve_once()


# ---------------------------------------------------------------- the GPU benchmark


def _bench_args(*extra: str, target: str = "T", draft: str = "D") -> argparse.Namespace:
    return bench.parse_args(["--target", target, "--draft", draft, *extra])


@pytest.mark.parametrize("algorithm", ["EAGLE3", "GRAFT", "NONE"])
def test_bench_launch_lines_resolve_in_sglang(sglang_server_args, stand_ins, algorithm):
    args = _bench_args("--tp", "8", "--graft-args", "--graft-gate-mode fixed",
                       target=stand_ins["target"], draft=stand_ins["draft"])
    cmd = bench.server_command(algorithm, args)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    sa, view = _resolve(sglang_server_args, cmd[3:])
    assert bench.reported_algorithm(sa.resolved_dict()) == algorithm
    assert view.tp_size == 8 and view.disable_overlap_schedule and view.cuda_graph_max_bs_decode == 32
    if algorithm != "NONE":
        budget = (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens)
        assert budget == (5, 4, 16) and view.speculative_draft_model_path == stand_ins["draft"]
    if algorithm == "GRAFT":
        assert sa._graft_settings.gates.mode == "fixed"


def test_bench_arguments():
    args = _bench_args()
    assert args.batch_sizes == (1, 8, 32) and args.algorithms == ("EAGLE3", "GRAFT")
    assert args.questions == ROOT.parent / "shared" / "data" / "spec_bench_question.jsonl"
    assert _bench_args("--batch-sizes", "4,2", "--algorithms", "none,graft").batch_sizes == (4, 2)
    assert _bench_args("--algorithms", "none,graft").algorithms == ("NONE", "GRAFT")
    assert _bench_args("--chat-template-kwargs", '{"enable_thinking": false}').chat_template_kwargs == {
        "enable_thinking": False
    }
    assert bench.parse_args(["--render-only", "--out", "x"]).render_only


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--target", "T", "--draft", "D", "--batch-sizes", "1,x"], "comma-separated integers"),
        (["--target", "T", "--draft", "D", "--batch-sizes", "8,8"], "distinct integers >= 1"),
        (["--target", "T", "--draft", "D", "--algorithms", "EAGLE3,MEDUSA"], "distinct names from"),
        (["--target", "T", "--draft", "D", "--topk", "1"], "GRAFT needs --topk > 1"),
        (["--target", "T", "--draft", "D", "--num-draft-tokens", "1"], "--num-draft-tokens must be >= 2"),
        (["--target", "T", "--draft", "D", "--extra-server-args", "--x 'unclosed"], "--extra-server-args"),
        (["--target", "T"], "--target and --draft are required"),
    ],
)
def test_bench_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_bench_topk_one_is_fine_without_graft():
    assert _bench_args("--topk", "1", "--algorithms", "EAGLE3").topk == 1


def _write_questions(path: Path, per_category: int = 4, categories=("writing", "math", "coding")) -> Path:
    rows, qid = [], 1
    for cat in categories:
        for _ in range(per_category):
            rows.append({"question_id": qid, "category": cat, "turns": [f"first {qid}", f"second {qid}"]})
            qid += 1
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_prompts_are_first_turns_in_disjoint_category_mixed_slices(tmp_path):
    questions = bench.load_first_turns(_write_questions(tmp_path / "q.jsonl"))
    assert len(questions) == 12 and questions[0].text == "first 1" and questions[0].category == "writing"
    slices = bench.split_prompts(questions, (1, 8), 6)
    ids = [[q.question_id for q in s] for s in slices.values()]
    assert set(ids[0]).isdisjoint(ids[1]) and all(len(i) == 6 for i in ids)
    for s in slices.values():
        assert {q.category for q in s} == {"writing", "math", "coding"}
    assert [q.category for q in bench.interleave_categories(questions)][:3] == ["writing", "math", "coding"]
    with pytest.raises(ValueError, match=r"2 batch sizes x 7 prompts = 14 distinct questions.*holds 12"):
        bench.split_prompts(questions, (1, 8), 7)


def test_bad_question_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="pass --questions PATH"):
        bench.load_first_turns(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a Spec-Bench question"):
        bench.load_first_turns(bad)


def test_launch_lines_differ_only_in_the_algorithm():
    args = _bench_args("--tp", "2", "--batch-sizes", "1,4", "--extra-server-args", "--mem-fraction-static 0.7",
                       "--graft-args", "--graft-policy pruned", "--port", "32000")
    eagle = bench.server_command("EAGLE3", args, python="py")
    graft = bench.server_command("GRAFT", args, python="py")
    plain = bench.server_command("NONE", args, python="py")
    assert eagle[:3] == graft[:3] == plain[:3] == ["py", "-m", "sglang.launch_server"]
    for cmd in (eagle, graft, plain):
        assert cmd[-2:] == ["--mem-fraction-static", "0.7"]  # user flags last: they win
        assert value_of(cmd, "--tp-size") == "2" and value_of(cmd, "--port") == "32000"
        assert value_of(cmd, "--cuda-graph-max-bs-decode") == "4" == value_of(cmd, "--max-running-requests")
        assert "--disable-overlap-schedule" in cmd
    assert value_of(eagle, "--speculative-algorithm") == "EAGLE3" and value_of(graft, "--speculative-algorithm") == "GRAFT"
    without = [a for a in graft if a not in ("GRAFT", "--graft-policy", "pruned")]
    assert without == [a for a in eagle if a != "EAGLE3"]
    assert "--graft-policy" not in eagle and not any(a.startswith("--speculative") for a in plain)


def test_run_batch_keeps_the_batch_size_in_flight():
    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def send(q):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.02)
        with lock:
            state["now"] -= 1
        return {"completion_tokens": q.question_id}, 0.02

    questions = [bench.Question(i, "c", f"t{i}") for i in range(12)]
    results, wall = bench.run_batch(send, questions, 4)
    assert state["peak"] == 4 and wall > 0
    assert [q.question_id for q, _, _ in results] == list(range(12))
    assert [meta["completion_tokens"] for _, meta, _ in results] == list(range(12))


def _meta(tokens: int, rounds: int | None, sources: list[dict] | None = None) -> dict:
    meta = {"prompt_tokens": 20, "completion_tokens": tokens}
    if rounds is not None:
        meta["spec_verify_ct"] = rounds
    if sources is not None:
        meta["graft_accepted"] = sources
    return meta


def test_summaries_and_results_table(tmp_path):
    setup = {"target": "T", "draft": "D", "tp": 8, "steps": 5, "topk": 4, "num_draft_tokens": 16, "max_new_tokens": 64}
    qa, qb = bench.Question(1, "math", "a"), bench.Question(2, "coding", "b")
    graft_rounds = [{"draft": 2, "recycling": 0, "context": 1, "history": 0, "filler": 0}, {"draft": 1, "history": 2}]
    reqs = {
        "NONE": [bench.request_record("NONE", 1, q, _meta(64, None), 2.0) for q in (qa, qb)],
        "EAGLE3": [bench.request_record("EAGLE3", 1, qa, _meta(64, 32), 1.0),
                   bench.request_record("EAGLE3", 1, qb, _meta(64, 16), 1.0)],
        "GRAFT": [bench.request_record("GRAFT", 1, qa, _meta(64, 16, graft_rounds), 0.5),
                  bench.request_record("GRAFT", 1, qb, _meta(64, 16, graft_rounds), 0.9)],
    }
    assert reqs["GRAFT"][0]["accepted_by_source"] == {"draft": 3, "recycling": 0, "context": 1, "history": 2, "filler": 0}
    assert "accepted_by_source" not in reqs["EAGLE3"][0]
    walls = {"NONE": 4.0, "EAGLE3": 2.0, "GRAFT": 1.0}
    runs = [bench.summarize_run(a, 1, reqs[a], walls[a], setup) for a in ("NONE", "EAGLE3", "GRAFT")]
    eagle, graft = runs[1], runs[2]
    assert eagle["output_tokens_per_s"] == 64.0 and eagle["tau"] == 128 / 48
    assert graft["output_tokens_per_s"] == 128.0 and graft["tau"] == 4.0
    assert graft["latency_p50_s"] == pytest.approx(0.7) and graft["latency_p90_s"] == 0.9
    assert runs[0]["tau"] is None and graft["accepted_by_source"]["history"] == 4
    bench._append_jsonl(tmp_path / "runs.jsonl", runs)
    bench._append_jsonl(tmp_path / "requests.jsonl", [r for a in reqs for r in reqs[a]])
    assert bench.main(["--render-only", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    head = "| batch size | NONE tok/s | EAGLE3 tok/s | GRAFT tok/s | GRAFT / EAGLE3 | EAGLE3 / plain | GRAFT / plain |"
    assert head in md
    assert "| 1 | 32.0 | 64.0 | 128.0 | 2.00x | 2.00x | 4.00x | 2.67 | 4.00 | 2.00 | 1.00 | 0.70 |" in md
    assert "| math | 2.00 | 4.00 |" in md and "| coding | 4.00 | 4.00 |" in md
    assert "| 1 | 50.0% | 0.0% | 16.7% | 33.3% | 0.0% |" in md
    assert "tp 8" in md and "5 steps, top-4, 16 verify tokens" in md


def test_empty_results_render():
    assert "No runs recorded" in bench.render_markdown([])


def test_refuses_without_sglang_or_gpus():
    with pytest.raises(bench.HostUnavailable, match="(?s)sglang is not installed.*sglang-graft bench"):
        bench.require_gpu_host(1, has_module=lambda name: False, cuda_available=lambda: True, device_count=lambda: 1)
    with pytest.raises(bench.HostUnavailable, match="(?s)no CUDA GPU.*sglang-graft bench"):
        bench.require_gpu_host(1, has_module=lambda name: True, cuda_available=lambda: False, device_count=lambda: 0)
    with pytest.raises(bench.HostUnavailable, match="(?s)--tp 8 needs 8 CUDA GPUs, but 1 are visible.*sglang-graft bench"):
        bench.require_gpu_host(8, has_module=lambda name: True, cuda_available=lambda: True, device_count=lambda: 1)
    bench.require_gpu_host(8, has_module=lambda name: True, cuda_available=lambda: True, device_count=lambda: 8)


def _no_launch(*args, **kwargs):
    raise AssertionError("the benchmark tried to start a process")


def test_main_refuses_before_launching_anything(monkeypatch, tmp_path, capsys):
    def no_gpu(**kwargs):
        raise ServeUnavailable("no CUDA GPU is visible, and SGLang's kernels need one.")

    monkeypatch.setattr(bench, "check_host", no_gpu)
    monkeypatch.setattr(bench.subprocess, "Popen", _no_launch)
    rc = bench.main(["--target", "T", "--draft", "D", "--out", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "sglang-graft bench" in err
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_plan_and_launches_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "require_gpu_host", _no_launch)
    monkeypatch.setattr(bench.subprocess, "Popen", _no_launch)
    questions = _write_questions(tmp_path / "q.jsonl")
    rc = bench.main(["--target", "T", "--draft", "D", "--dry-run", "--questions", str(questions),
                     "--batch-sizes", "1,2,4", "--num-prompts", "4"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "EAGLE3: " in out and "GRAFT: " in out and "--speculative-algorithm GRAFT" in out
    assert "batch size 4: 4 prompts" in out
    assert bench.main(["--target", "T", "--draft", "D", "--dry-run", "--questions", str(tmp_path / "none.jsonl")]) == 2


#: A stand-in for SGLang's HTTP server (argv: port, algorithm): the endpoints the benchmark
#: calls, answering /generate with ``max_new_tokens`` tokens in ``tokens / tau`` verify
#: rounds (tau 2 for EAGLE3, 4 for GRAFT, with Graft's per-round source counts).
FAKE_SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, algo = int(sys.argv[1]), sys.argv[2]
class H(BaseHTTPRequestHandler):
    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health_generate": self._send(200, {})
        elif self.path == "/server_info": self._send(200, {"speculative_algorithm": None if algo == "NONE" else algo})
        else: self._send(404, {})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/flush_cache": return self._send(200, {})
        assert req["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 8}, req
        meta = {"prompt_tokens": len(req["text"]), "completion_tokens": 8}
        if algo != "NONE":
            meta["spec_verify_ct"] = 4 if algo == "EAGLE3" else 2
        if algo == "GRAFT":
            meta["graft_accepted"] = [{"draft": 2, "history": 1}, {"draft": 1, "context": 2}]
        self._send(200, {"text": "x", "meta_info": meta})
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_main_end_to_end_against_a_fake_server(monkeypatch, tmp_path, capsys):
    port = _free_port()
    monkeypatch.setattr(bench, "require_gpu_host", lambda tp: None)
    monkeypatch.setattr(bench, "host_fields", lambda: {"gpu": "fake", "num_gpus": 1, "sglang": "0"})
    monkeypatch.setattr(bench, "server_command", lambda algo, args: [sys.executable, "-c", FAKE_SERVER, str(port), algo])
    monkeypatch.setattr(bench.Server, "POLL_S", 0.05)
    out = tmp_path / "out"
    rc = bench.main([
        "--target", "T", "--draft", "D", "--questions", str(_write_questions(tmp_path / "q.jsonl")),
        "--batch-sizes", "1,3", "--num-prompts", "5", "--max-new-tokens", "8", "--algorithms", "NONE,EAGLE3,GRAFT",
        "--no-chat-template", "--port", str(port), "--out", str(out),
    ])
    assert rc == 0
    runs = bench.read_jsonl(out / "runs.jsonl")
    assert [(r["algorithm"], r["batch_size"]) for r in runs] == [
        (a, bs) for a in ("NONE", "EAGLE3", "GRAFT") for bs in (1, 3)
    ]
    assert {r["algorithm"]: r["tau"] for r in runs} == {"NONE": None, "EAGLE3": 2.0, "GRAFT": 4.0}
    assert all(r["output_tokens"] == 40 and r["num_prompts"] == 5 and r["gpu"] == "fake" for r in runs)
    graft = runs[-1]["accepted_by_source"]
    assert (graft["draft"], graft["context"], graft["history"]) == (15, 10, 5)
    reqs = bench.read_jsonl(out / "requests.jsonl")
    assert len(reqs) == 30 and {r["prompt_tokens"] for r in reqs} == {len("first 1"), len("first 10")}
    assert "| GRAFT / EAGLE3 |" in (out / "results.md").read_text()
    assert json.loads((out / "server_info_GRAFT.json").read_text()) == {"speculative_algorithm": "GRAFT"}
    assert "GRAFT / EAGLE3" in capsys.readouterr().out


def test_a_server_running_the_wrong_algorithm_is_refused(monkeypatch, tmp_path):
    port = _free_port()
    monkeypatch.setattr(bench, "server_command", lambda algo, args: [sys.executable, "-c", FAKE_SERVER, str(port), "EAGLE3"])
    monkeypatch.setattr(bench.Server, "POLL_S", 0.05)
    args = _bench_args("--port", str(port), "--out", str(tmp_path))
    with pytest.raises(RuntimeError, match="asked for GRAFT, but the server reports speculative_algorithm=EAGLE3"):
        bench.bench_algorithm("GRAFT", args, {1: [bench.Question(1, "c", "t")]}, lambda text: text)
    assert (tmp_path / "server_GRAFT.log").exists()


def test_a_server_that_dies_while_loading_is_reported(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('weights missing'); sys.exit(3)"]
    server = bench.Server(cmd, tmp_path / "log", f"http://127.0.0.1:{_free_port()}", timeout=30)
    server.POLL_S = 0.05
    with pytest.raises(RuntimeError, match="(?s)server exited with 3 while loading.*weights missing"):
        with server:
            pass


def test_a_server_that_never_gets_ready_is_stopped(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    server = bench.Server(cmd, tmp_path / "log", f"http://127.0.0.1:{_free_port()}", timeout=0.5)
    server.POLL_S = 0.05
    with pytest.raises(TimeoutError, match="(?s)server not ready after 0s.*loading"):
        server.__enter__()
    assert server.proc.poll() is not None  # stopped, not left loading in the background
