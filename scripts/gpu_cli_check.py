#!/usr/bin/env python3
"""The ``sglang-graft`` command on a device, end to end, on the tiny pair (no weights needed).

``generate`` runs every policy on one prompt and all must return the same token ids as
``ar``; then, when a Spec-Bench question file is given and exists, a small ``bench`` runs
every policy and transformers' two baselines, and ours must be identical to ``ar`` on every
prompt. This is what ``scripts/gpu_check.sh`` runs on a GPU host (``--device cuda``); it
works on the CPU too:

    python scripts/gpu_cli_check.py --device cuda --questions spec_bench_question.jsonl --out bench-out

Exit status 1 when any output differs from ``ar`` or a command fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_graft.cli import main as cli  # noqa: E402

TINY = ["--target", "tiny", "--draft", "tiny"]
POLICIES = ("ar", "dense", "pruned", "retrieval", "graft")
BASELINES = ("hf-assisted", "hf-pld")


def run(argv: list[str]) -> tuple[int, str]:
    """One ``sglang-graft`` command in this process: its exit status and what it printed."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli(argv)
    print(buf.getvalue(), end="")
    return rc, buf.getvalue()


def check_generate(device: str, new_tokens: int) -> list[str]:
    """Every policy's token ids for one prompt, against ``ar``'s; returns the problems."""
    problems, ids = [], {}
    for policy in POLICIES:
        rc, out = run(["generate", *TINY, "--device", device, "--policy", policy, "--prompt", "abcabcabc abc",
                       "--max-new-tokens", str(new_tokens), "--json"])
        if rc != 0:
            problems.append(f"generate --policy {policy} exited {rc}")
            continue
        ids[policy] = json.loads(out.strip().splitlines()[-1])["token_ids"]
    problems += [f"generate --policy {p} differs from ar" for p in ids if "ar" in ids and ids[p] != ids["ar"]]
    return problems


def check_bench(device: str, questions: Path, out: Path, new_tokens: int) -> list[str]:
    """A one-question-per-category bench on ``device``; ours must equal ``ar`` everywhere."""
    rc, _ = run(["bench", *TINY, "--device", device, "--questions", str(questions), "--per-category", "1",
                 "--max-new-tokens", str(new_tokens), "--policies", ",".join(POLICIES + BASELINES), "--out", str(out)])
    if rc != 0:
        return [f"bench exited {rc}"]
    results = json.loads((out / "results.json").read_text())["policies"]
    problems = []
    for name in POLICIES:
        overall = results[name]["overall"]
        if overall["identical_to_ar"] != 1.0:
            problems.append(f"bench: {name} is identical to ar on {overall['identical_to_ar']:.0%} of prompts")
    for name, r in results.items():
        o = r["overall"]
        print(f"bench {name:>12}: {o['tokens_per_s']:8.1f} tok/s  {o['speedup_vs_ar']:.2f}x  tau {o['tau']:.2f}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="torch device (default cuda)")
    ap.add_argument("--questions", type=Path, default=None, help="Spec-Bench question.jsonl (bench skipped if absent)")
    ap.add_argument("--out", type=Path, default=Path("gpu_cli_check_out"), help="bench output folder")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    problems = check_generate(args.device, args.max_new_tokens)
    if args.questions is not None and args.questions.is_file():
        problems += check_bench(args.device, args.questions, args.out, args.max_new_tokens)
    else:
        print(f"[gpu_cli_check] bench skipped: no question file at {args.questions}")
    for p in problems:
        print(f"[gpu_cli_check] {p}")
    print("gpu_cli_check:", "FAILED" if problems else "passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
