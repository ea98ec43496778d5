"""GRAFT against EAGLE-3 in SGLang's own server, on a CUDA host: tokens/s, tau and latency.

For each algorithm the script starts one SGLang server (``python -m sglang.launch_server``;
GRAFT through ``sglang-graft serve``'s command line) with the same target, draft, tensor
parallelism and draft budget (steps, top-k, verify tokens), sends Spec-Bench first turns
greedily (temperature 0) at each batch size, stops the server, and moves to the next
algorithm: a 235B target leaves no room for two servers at once. It writes

* ``runs.jsonl``: one line per (algorithm, batch size): output tokens/s, tau, latency;
* ``requests.jsonl``: one line per request (question, category, tokens, verify rounds);
* ``results.md``: GRAFT against EAGLE-3 per batch size, tau per category, and the share
  of GRAFT's accepted tokens per source;
* ``server_<ALGO>.log`` and ``server_info_<ALGO>.json``: each server's log and resolved
  configuration (the script checks that the server really runs the algorithm asked for).

    python scripts/bench_sglang_gpu.py --target Qwen/Qwen3-8B --draft Tengyunw/qwen3_8b_eagle3 \\
        --tp 1 --batch-sizes 1,8,32 --num-prompts 64 --max-new-tokens 256 --out bench-gpu
    python scripts/bench_sglang_gpu.py --target Qwen/Qwen3-235B-A22B \\
        --draft lmsys/Qwen3-235B-A22B-EAGLE3 --tp 8 --extra-server-args "--mem-fraction-static 0.85"
    python scripts/bench_sglang_gpu.py ... --dry-run       # print the plan, launch nothing
    python scripts/bench_sglang_gpu.py --out DIR --render-only   # rebuild results.md

How it measures, and why:

* Prompts: the first turn of each Spec-Bench question (``--questions``, never copied into
  the repo), rendered with the target's chat template on the client and sent as text to
  ``/generate``, so every server sees byte-identical input. Categories are interleaved.
* Each batch size gets its own slice of questions (the same slice for every algorithm).
  GRAFT's history source learns from earlier outputs, so a prompt repeated at a later
  batch size would be answered from its own earlier output; disjoint slices keep every
  measurement about unseen prompts. The prefix cache is flushed before each batch size.
* Batch size b means b client threads, each sending its next prompt when its previous
  one returns (closed loop), so the server holds b requests until the last ones drain.
* Output tokens/s = all completion tokens / wall time of the batch-size run. tau = all
  completion tokens / all verify rounds, from each response's ``meta_info``
  (``completion_tokens``, ``spec_verify_ct``): SGLang's own ``spec_accept_length``,
  pooled over requests. Latency is per request, measured on the client.
* Both algorithms run with ``--disable-overlap-schedule`` (Graft refuses the overlap
  scheduler), so the comparison isolates the tree, not the scheduler. ``NONE`` (plain
  decoding, same scheduler) can be added to ``--algorithms`` for speedups over it.
* Servers run one after another on a noisy machine: compare the ratios of one session,
  not absolute numbers across sessions.

On a host without a CUDA GPU or without sglang the script refuses and points to
``sglang-graft bench``, the CPU comparison of Graft's policies on the reference engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sglang_graft.serve import ServeUnavailable, check_host, serve_command  # noqa: E402

#: Algorithms this script can launch, in the order tables list them.
ALGORITHMS: tuple[str, ...] = ("NONE", "EAGLE3", "GRAFT")
#: Graft's accepted-token sources as reported in ``meta_info["graft_accepted"]``.
SOURCES: tuple[str, ...] = ("draft", "recycling", "context", "history", "filler")
DEFAULT_QUESTIONS = ROOT.parent / "shared" / "data" / "spec_bench_question.jsonl"
CPU_BENCH_HINT = (
    "For a CPU comparison of Graft's policies on the reference engine, run e.g.\n"
    "  sglang-graft bench --target TARGET --draft DRAFT --questions spec_bench_question.jsonl "
    "--per-category 3 --max-new-tokens 128 --out bench-out"
)
#: A fixed warm-up prompt outside Spec-Bench (warm-up output must not teach Graft's history
#: anything about the measured prompts).
WARMUP_PROMPT = "List the planets of the solar system in order from the sun."


class HostUnavailable(RuntimeError):
    """This host cannot run the GPU benchmark; the message says why and what to run instead."""


# ---------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes are comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be distinct integers >= 1, got {text!r}")
    return sizes


def _algorithms(text: str) -> tuple[str, ...]:
    names = tuple(s.strip().upper() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in ALGORITHMS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"algorithms are distinct names from {ALGORITHMS}, got {text!r}")
    return names


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_sglang_gpu.py",
        description="GRAFT vs EAGLE-3 in SGLang's server on Spec-Bench (CUDA host).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target", help="target model (hub id or path); required unless --render-only")
    p.add_argument("--draft", help="EAGLE-3 draft head (hub id or path); required unless --render-only")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size of each server")
    p.add_argument("--batch-sizes", type=_batch_sizes, default="1,8,32", help="comma-separated concurrencies")
    p.add_argument("--num-prompts", type=_positive_int, default=32, help="prompts per batch size")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256)
    p.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    p.add_argument("--out", type=Path, default=Path("bench-sglang-gpu"), help="output directory")
    p.add_argument("--algorithms", type=_algorithms, default="EAGLE3,GRAFT",
                   help=f"comma-separated, from {','.join(ALGORITHMS)} (NONE: plain decoding)")
    p.add_argument("--steps", type=_positive_int, default=5, help="--speculative-num-steps (every speculative algorithm)")
    p.add_argument("--topk", type=_positive_int, default=4, help="--speculative-eagle-topk (GRAFT needs > 1)")
    p.add_argument("--num-draft-tokens", type=_positive_int, default=16,
                   help="--speculative-num-draft-tokens, the verify budget n (root included)")
    p.add_argument("--extra-server-args", default="",
                   help="more SGLang flags for every server, one string; a single flag needs '=': "
                        "--extra-server-args=--enable-metrics")
    p.add_argument("--graft-args", default="",
                   help="--graft-* flags for the GRAFT server only, one string (e.g. '--graft-policy pruned')")
    p.add_argument("--port", type=_positive_int, default=31000, help="port of the server under test")
    p.add_argument("--server-timeout", type=float, default=3600.0, help="seconds to wait for a server to load")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds one request may take")
    p.add_argument("--no-chat-template", action="store_true", help="send the raw question text")
    p.add_argument("--chat-template-kwargs", type=_json_object, default={},
                   help="JSON passed to apply_chat_template, e.g. '{\"enable_thinking\": false}' for Qwen3")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and prompt split; launch nothing")
    p.add_argument("--render-only", action="store_true", help="rebuild results.md from --out's JSONL files")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.render_only:
        if not args.target or not args.draft:
            parser.error("--target and --draft are required (unless --render-only)")
        if "GRAFT" in args.algorithms and args.topk < 2:
            parser.error("GRAFT needs --topk > 1 (it grafts retrieved chains into a tree)")
        if args.num_draft_tokens < 2:
            parser.error("--num-draft-tokens must be >= 2 (the root plus at least one proposal)")
        for name in ("extra_server_args", "graft_args"):
            try:
                shlex.split(getattr(args, name))
            except ValueError as e:
                parser.error(f"--{name.replace('_', '-')}: {e}")
    return args


# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Question:
    """One Spec-Bench question: its id, category and first turn."""

    question_id: Any
    category: str
    text: str


def load_first_turns(path: Path) -> list[Question]:
    """The first turn of every question in a Spec-Bench ``question.jsonl``."""
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench questions not found at {path}; pass --questions PATH")
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(Question(row["question_id"], row.get("category", "unknown"), row["turns"][0]))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not a Spec-Bench question ({e!r})") from None
    if not out:
        raise ValueError(f"{path} holds no questions")
    return out


def interleave_categories(questions: Sequence[Question]) -> list[Question]:
    """Round-robin over categories (in order of first appearance), keeping file order
    within each, so any prefix of the result mixes every category."""
    by_cat: dict[str, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    out: list[Question] = []
    for i in range(max(len(v) for v in by_cat.values())):
        out += [v[i] for v in by_cat.values() if i < len(v)]
    return out


def split_prompts(questions: Sequence[Question], batch_sizes: Sequence[int], num_prompts: int) -> dict[int, list[Question]]:
    """Disjoint slices of ``num_prompts`` questions, one per batch size. Slice i takes every
    S-th question (S batch sizes) of the category-interleaved order, so each slice cycles
    through the categories instead of covering only a few of them."""
    need = num_prompts * len(batch_sizes)
    if need > len(questions):
        raise ValueError(
            f"{len(batch_sizes)} batch sizes x {num_prompts} prompts = {need} distinct questions, but the file "
            f"holds {len(questions)}; lower --num-prompts (each batch size needs unseen prompts, see --help)"
        )
    mixed = interleave_categories(questions)
    stride = len(batch_sizes)
    return {bs: mixed[i::stride][:num_prompts] for i, bs in enumerate(batch_sizes)}


def chat_renderer(target: str, template_kwargs: dict) -> Callable[[str], str]:
    """``text -> prompt`` with the target's chat template (one user turn, generation prompt)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)

    def render(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)

    return render


# ---------------------------------------------------------------- servers


def server_command(algorithm: str, args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """The launch line of one algorithm's server. Every algorithm shares the target, TP,
    scheduler, CUDA-graph sizes and (for the speculative ones) draft and budget; only the
    algorithm name and GRAFT's own flags differ. User flags come last, so they win."""
    top = max(args.batch_sizes)
    common = [
        "--model-path", args.target, "--tp-size", str(args.tp),
        "--host", "127.0.0.1", "--port", str(args.port),
        "--disable-overlap-schedule",
        "--cuda-graph-max-bs-decode", str(top), "--max-running-requests", str(top),
    ]
    spec = [
        "--speculative-draft-model-path", args.draft,
        "--speculative-num-steps", str(args.steps),
        "--speculative-eagle-topk", str(args.topk),
        "--speculative-num-draft-tokens", str(args.num_draft_tokens),
    ]
    extra = shlex.split(args.extra_server_args)
    if algorithm == "NONE":
        return [python, "-m", "sglang.launch_server", *common, *extra]
    if algorithm == "EAGLE3":
        return [python, "-m", "sglang.launch_server", *common, "--speculative-algorithm", "EAGLE3", *spec, *extra]
    if algorithm == "GRAFT":
        cmd = serve_command([*common, "--speculative-algorithm", "GRAFT", *spec, *shlex.split(args.graft_args), *extra])
        return [python, *cmd[1:]]
    raise ValueError(f"unknown algorithm {algorithm!r}; valid: {ALGORITHMS}")


def require_gpu_host(
    tp: int,
    has_module: Callable[[str], bool] | None = None,
    cuda_available: Callable[[], bool] | None = None,
    device_count: Callable[[], int] | None = None,
) -> None:
    """Raise ``HostUnavailable`` unless sglang is installed and ``tp`` CUDA GPUs are visible."""
    kwargs: dict[str, Any] = {"cuda_available": cuda_available}
    if has_module is not None:
        kwargs["has_module"] = has_module
    try:
        check_host(**kwargs)
    except ServeUnavailable as e:
        raise HostUnavailable(f"{e}\n{CPU_BENCH_HINT}") from None
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count
    found = device_count()
    if found < tp:
        raise HostUnavailable(f"--tp {tp} needs {tp} CUDA GPUs, but {found} are visible.\n{CPU_BENCH_HINT}")


def _http(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    """One SGLang server process in its own process group, stopped as a group on exit
    (tensor parallelism forks a scheduler per GPU)."""

    #: Seconds between readiness probes while the server loads.
    POLL_S = 5.0

    def __init__(self, cmd: list[str], log_path: Path, base_url: str, timeout: float) -> None:
        self.cmd, self.log_path, self.base_url, self.timeout = cmd, log_path, base_url, timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        self._log = open(self.log_path, "w")
        print("[bench] " + shlex.join(self.cmd), file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()  # a server that never became ready (or a Ctrl-C) must not outlive us
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while loading:\n{self._tail()}")
            try:
                if _http(self.base_url + "/health_generate", timeout=30)[0] == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(self.POLL_S)
        raise TimeoutError(f"server not ready after {self.timeout:.0f}s:\n{self._tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def _tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def reported_algorithm(server_info: dict) -> str:
    """The algorithm a running server resolved to, from ``/server_info`` (its resolved
    ``ServerArgs`` fields); ``NONE`` for plain decoding."""
    return str(server_info.get("speculative_algorithm") or "NONE").upper()


def generate(base_url: str, prompt: str, max_new_tokens: int, timeout: float) -> tuple[dict, float]:
    """One greedy ``/generate`` call: ``(meta_info, client latency in seconds)``."""
    body = {"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
    t0 = time.perf_counter()
    status, raw = _http(base_url + "/generate", body, timeout=timeout)
    latency = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"/generate returned HTTP {status}: {raw[:500]!r}")
    return json.loads(raw)["meta_info"], latency


def run_batch(
    send: Callable[[Question], tuple[dict, float]], questions: Sequence[Question], batch_size: int
) -> tuple[list[tuple[Question, dict, float]], float]:
    """Send every question with ``batch_size`` in flight (closed loop); results in
    question order and the wall time from first send to last answer."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=batch_size) as pool:
        answers = list(pool.map(send, questions))
    wall = time.perf_counter() - t0
    return [(q, meta, lat) for q, (meta, lat) in zip(questions, answers)], wall


# ---------------------------------------------------------------- summaries


def graft_source_counts(meta: dict) -> dict[str, int]:
    """Accepted proposals per source of one response (``meta_info["graft_accepted"]``
    holds one ``{source: tokens}`` dict per verify round); empty for other algorithms."""
    rounds = meta.get("graft_accepted") or []
    totals = dict.fromkeys(SOURCES, 0)
    for row in rounds:
        for name, count in row.items():
            totals[name] = totals.get(name, 0) + int(count)
    return totals if rounds else {}


def request_record(algorithm: str, batch_size: int, q: Question, meta: dict, latency: float) -> dict:
    """One ``requests.jsonl`` line."""
    rec = {
        "algorithm": algorithm, "batch_size": batch_size, "question_id": q.question_id, "category": q.category,
        "prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": int(meta.get("completion_tokens", 0)),
        "verify_rounds": int(meta.get("spec_verify_ct", 0) or 0), "latency_s": latency,
    }
    sources = graft_source_counts(meta)
    if sources:
        rec["accepted_by_source"] = sources
    return rec


def _nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile by nearest rank: the smallest value with at least ``q`` of the
    values at or below it (a latency some request actually had)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize_run(algorithm: str, batch_size: int, requests: Sequence[dict], wall_s: float, setup: dict) -> dict:
    """One ``runs.jsonl`` line from the ``requests.jsonl`` lines of one batch-size run."""
    tokens = sum(r["completion_tokens"] for r in requests)
    rounds = sum(r["verify_rounds"] for r in requests)
    latencies = [r["latency_s"] for r in requests]
    rec = {
        "algorithm": algorithm, "batch_size": batch_size, "num_prompts": len(requests),
        "output_tokens": tokens, "wall_s": wall_s, "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "tau": tokens / rounds if rounds else None, "verify_rounds": rounds,
        "latency_mean_s": statistics.fmean(latencies), "latency_p50_s": statistics.median(latencies),
        "latency_p90_s": _nearest_rank(latencies, 0.9), **setup,
    }
    totals: dict[str, int] = {}
    for r in requests:
        for name, count in r.get("accepted_by_source", {}).items():
            totals[name] = totals.get(name, 0) + count
    if totals:
        rec["accepted_by_source"] = totals
    return rec


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_markdown(runs: Sequence[dict], requests: Sequence[dict] = ()) -> str:
    """``results.md``: per batch size, tokens/s and tau of every algorithm and the speedups
    of GRAFT over EAGLE-3 (and of both over plain decoding when NONE ran); tau per
    category; GRAFT's accepted tokens per source."""
    if not runs:
        return "# SGLang GPU benchmark\n\nNo runs recorded.\n"
    algos = [a for a in ALGORITHMS if any(r["algorithm"] == a for r in runs)]
    spec_algos = [a for a in algos if a != "NONE"]
    cell = {(r["algorithm"], r["batch_size"]): r for r in runs}
    sizes = sorted({r["batch_size"] for r in runs})
    first = runs[0]
    lines = [
        "# SGLang GPU benchmark: GRAFT vs EAGLE-3",
        "",
        f"Target `{first.get('target')}`, draft `{first.get('draft')}`, tp {first.get('tp')}; draft budget: "
        f"{first.get('steps')} steps, top-{first.get('topk')}, {first.get('num_draft_tokens')} verify tokens; greedy, "
        f"up to {first.get('max_new_tokens')} new tokens; Spec-Bench first turns, a separate slice of "
        f"{first.get('num_prompts')} per batch size. Servers ran one after another: compare ratios, not "
        "absolute numbers across sessions.",
        "",
    ]
    ratios: list[tuple[str, str, str]] = []
    if "GRAFT" in algos and "EAGLE3" in algos:
        ratios.append(("GRAFT / EAGLE3", "GRAFT", "EAGLE3"))
    if "NONE" in algos:
        ratios += [(f"{a} / plain", a, "NONE") for a in spec_algos]
    head = ["batch size"] + [f"{a} tok/s" for a in algos] + [r[0] for r in ratios]
    head += [f"{a} tau" for a in spec_algos] + [f"{a} p50 latency s" for a in algos]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bs in sizes:
        row = [str(bs)]
        row += [_fmt(cell.get((a, bs), {}).get("output_tokens_per_s"), ".1f") for a in algos]
        for _, num, den in ratios:
            n = cell.get((num, bs), {}).get("output_tokens_per_s")
            d = cell.get((den, bs), {}).get("output_tokens_per_s")
            row.append(f"{n / d:.2f}x" if n and d else "-")
        row += [_fmt(cell.get((a, bs), {}).get("tau"), ".2f") for a in spec_algos]
        row += [_fmt(cell.get((a, bs), {}).get("latency_p50_s"), ".2f") for a in algos]
        lines.append("| " + " | ".join(row) + " |")

    spec_requests = [r for r in requests if r["algorithm"] in spec_algos]
    if spec_requests:
        lines += ["", "## tau per category (all batch sizes pooled)", ""]
        cats = sorted({r["category"] for r in spec_requests})
        lines += ["| category | " + " | ".join(f"{a} tau" for a in spec_algos) + " |", "|" + "---|" * (1 + len(spec_algos))]
        for cat in cats:
            row = [cat]
            for a in spec_algos:
                sel = [r for r in spec_requests if r["algorithm"] == a and r["category"] == cat]
                rounds = sum(r["verify_rounds"] for r in sel)
                row.append(_fmt(sum(r["completion_tokens"] for r in sel) / rounds if rounds else None, ".2f"))
            lines.append("| " + " | ".join(row) + " |")

    graft_runs = [cell[("GRAFT", bs)] for bs in sizes if ("GRAFT", bs) in cell and cell[("GRAFT", bs)].get("accepted_by_source")]
    if graft_runs:
        lines += ["", "## GRAFT: share of accepted proposals per source", ""]
        lines += ["| batch size | " + " | ".join(SOURCES) + " |", "|" + "---|" * (1 + len(SOURCES))]
        for r in graft_runs:
            counts = r["accepted_by_source"]
            total = sum(counts.values())
            lines.append(f"| {r['batch_size']} | " + " | ".join(
                f"{100 * counts.get(s, 0) / total:.1f}%" if total else "-" for s in SOURCES) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def _setup_fields(args: argparse.Namespace) -> dict:
    return {
        "target": args.target, "draft": args.draft, "tp": args.tp, "steps": args.steps, "topk": args.topk,
        "num_draft_tokens": args.num_draft_tokens, "max_new_tokens": args.max_new_tokens,
    }


def _append_jsonl(path: Path, records: Iterable[dict]) -> None:
    with open(path, "a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def write_results(out: Path) -> Path:
    path = out / "results.md"
    path.write_text(render_markdown(read_jsonl(out / "runs.jsonl"), read_jsonl(out / "requests.jsonl")))
    return path


def host_fields() -> dict:
    """What ran the benchmark (recorded with every run): GPU model and count, sglang version."""
    from importlib.metadata import version

    import torch

    return {"gpu": torch.cuda.get_device_name(0), "num_gpus": torch.cuda.device_count(), "sglang": version("sglang")}


def bench_algorithm(algorithm: str, args: argparse.Namespace, slices: dict[int, list[Question]],
                    render: Callable[[str], str], setup: dict | None = None) -> None:
    """Start one server, run every batch size against it, append the JSONL lines
    (``setup``: fields recorded with every run, by default the benchmark's settings)."""
    setup = _setup_fields(args) if setup is None else setup
    base_url = f"http://127.0.0.1:{args.port}"
    out: Path = args.out
    with Server(server_command(algorithm, args), out / f"server_{algorithm}.log", base_url, args.server_timeout):
        status, raw = _http(base_url + "/server_info", timeout=60)
        info = json.loads(raw) if status == 200 else {}
        (out / f"server_info_{algorithm}.json").write_text(json.dumps(info, indent=1, default=str))
        running = reported_algorithm(info)
        if running != algorithm:
            raise RuntimeError(f"asked for {algorithm}, but the server reports speculative_algorithm={running}")

        def send(q: Question) -> tuple[dict, float]:
            return generate(base_url, render(q.text), args.max_new_tokens, args.request_timeout)

        warm = Question("warmup", "warmup", WARMUP_PROMPT)
        run_batch(send, [warm] * min(4, max(args.batch_sizes)), min(4, max(args.batch_sizes)))
        for bs, questions in slices.items():
            status, raw = _http(base_url + "/flush_cache", body={}, timeout=60)
            if status != 200:
                print(f"[bench] warning: /flush_cache answered {status}: {raw[:200]!r}", file=sys.stderr)
            results, wall = run_batch(send, questions, bs)
            reqs = [request_record(algorithm, bs, q, meta, lat) for q, meta, lat in results]
            run = summarize_run(algorithm, bs, reqs, wall, setup)
            _append_jsonl(out / "requests.jsonl", reqs)
            _append_jsonl(out / "runs.jsonl", [run])
            print(f"[bench] {algorithm} bs={bs}: {_fmt(run['output_tokens_per_s'], '.1f')} tok/s, "
                  f"tau {_fmt(run['tau'], '.2f')}, p50 latency {run['latency_p50_s']:.2f}s", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        print(write_results(args.out).read_text())
        return 0
    if not args.dry_run:
        try:
            require_gpu_host(args.tp)
        except HostUnavailable as e:
            print(f"bench_sglang_gpu: {e}", file=sys.stderr)
            return 2
    try:
        slices = split_prompts(load_first_turns(args.questions), args.batch_sizes, args.num_prompts)
    except (FileNotFoundError, ValueError) as e:
        print(f"bench_sglang_gpu: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for algorithm in args.algorithms:
            print(f"{algorithm}: {shlex.join(server_command(algorithm, args))}")
        for bs, questions in slices.items():
            cats = sorted({q.category for q in questions})
            print(f"batch size {bs}: {len(questions)} prompts, question ids {questions[0].question_id}.."
                  f"{questions[-1].question_id}, categories {','.join(cats)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("runs.jsonl", "requests.jsonl"):
        (args.out / name).unlink(missing_ok=True)  # one session per directory: ratios stay within it
    render = (lambda text: text) if args.no_chat_template else chat_renderer(args.target, args.chat_template_kwargs)
    setup = {**_setup_fields(args), **host_fields()}
    for algorithm in args.algorithms:
        bench_algorithm(algorithm, args, slices, render, setup)
        write_results(args.out)
    print(write_results(args.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
