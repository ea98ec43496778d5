#!/usr/bin/env python3
"""Milliseconds per forward of the target and the draft for 1..32 new tokens on a cached
context, and the ``--draft-cost-ratio`` they imply.

Whether speculation pays on a host depends on two numbers: how much more a verify forward
over ``n`` tokens costs than a one-token decode step, and what a draft forward costs next
to a verify. Both vary a lot between CPUs (with and without native bf16 matrix multiply)
and dtypes, so measure them before choosing ``--num-nodes`` and ``--draft-cost-ratio``:

    .venv/bin/python scripts/bench_forward_cost.py --target TARGET --draft DRAFT --dtype bfloat16 --threads 2

Prints a table (median of --reps forwards after one warm-up); no assertions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def forward_ms(model: torch.nn.Module, context: int, new_tokens: int, reps: int, vocab: int) -> float:
    """Median milliseconds of a ``new_tokens`` forward after ``context`` cached tokens."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = model(torch.randint(0, vocab, (1, context), generator=gen), use_cache=True).past_key_values
        times = []
        for _ in range(reps + 1):
            x = torch.randint(0, vocab, (1, new_tokens), generator=gen)
            start = time.perf_counter()
            model(x, past_key_values=cache, use_cache=True, logits_to_keep=new_tokens)
            times.append(time.perf_counter() - start)
            cache.crop(-new_tokens)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model folder (transformers format)")
    ap.add_argument("--draft", required=True, help="draft model folder")
    ap.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed forward (default 256)")
    ap.add_argument("--tokens", default="1,2,4,8,16,32", help="new-token counts to time")
    ap.add_argument("--verify-tokens", type=int, default=8, help="n whose verify cost the ratio divides by (default 8)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = sorted({*map(int, args.tokens.split(",")), 1, args.verify_tokens})
    ms: dict[str, dict[int, float]] = {}
    for role, path in (("target", args.target), ("draft", args.draft)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        vocab = int(model.config.get_text_config().vocab_size)
        ms[role] = {q: forward_ms(model, args.context, q, args.reps, vocab) for q in counts}
        del model
    print(f"dtype={args.dtype} threads={torch.get_num_threads()} context={args.context} (median ms per forward)")
    print(f"{'tokens':>7} {'target':>9} {'x 1-token':>10} {'draft':>9}")
    for q in counts:
        print(f"{q:>7} {ms['target'][q]:>9.0f} {ms['target'][q] / ms['target'][1]:>10.2f} {ms['draft'][q]:>9.0f}")
    ratio = ms["draft"][1] / ms["target"][args.verify_tokens]
    print(f"--draft-cost-ratio {ratio:.2f}  (draft 1-token forward / target {args.verify_tokens}-token verify)")


if __name__ == "__main__":
    main()
