#!/usr/bin/env python3
"""Milliseconds per forward of the target and the draft for 1..32 new tokens on a cached
context, and the ``--num-nodes`` and ``--draft-cost-ratio`` they imply.

Whether speculation pays on a host depends on two numbers: how much more a verify forward
over ``n`` tokens costs than a one-token decode step, and what a draft forward costs next
to a verify. Both vary a lot between CPUs (with and without native bf16 matrix multiply)
and dtypes, so measure them before choosing ``--num-nodes`` and ``--draft-cost-ratio``:

    .venv/bin/python scripts/bench_forward_cost.py --target TARGET --draft DRAFT --dtype bfloat16 --threads 2

The recommended ``--num-nodes`` is the largest measured count whose verify costs at most
``--verify-slack`` (default 1.1x) a one-token decode step: on the hosts measured so far
that was 16 on two Intel Xeons with AMX (a 16-token forward cost what a 1-token one does,
24 tokens 1.3x), 8 on an AVX2 AMD EPYC (16 tokens 1.18x), and on a Zen 4 EPYC with
AVX512-BF16 12 with PyTorch's bf16 matmuls (16 tokens 1.27x; a one-token forward cost
more than a two-token one, 297 against 246 ms) and 4 with the project's kernel there
(166 ms for 1 token, 190 for 8, 213 for 12: faster at every count, but steeper); on a
Zen 5 EPYC with the kernel 4, 8 or 12 from one run to the next (87-100 ms for 1 token, 105-127
for 12: on such a host rerun it, or pass a curve to --verify-costs). Both
models stay loaded and every count of both is timed round-robin, so a host whose speed
drifts between minutes slows them all alike (the draft/target ratio most of all needs that).

It also prints the whole curve as ``--verify-costs``: with it, ``pruned``, ``retrieval``
and ``graft`` choose each round's verify width themselves (up to ``--num-nodes``), keeping
only the nodes whose expected tokens pay for the extra verify time on this host, instead
of always verifying a fixed ``n``. Last, a draft prefill over ``--prefill-tokens`` fresh
tokens gives ``--draft-read-cost``: what one unread prompt token adds to the draft's first
forward on a request, which ``graft`` weighs before prefilling the draft on a prompt that
retrieval might copy instead (an int8 draft's one-token forward halves, its prefill does not).

The draft's cost is that of a forward over ``--draft-width`` tokens (default 8), because a
drafted level feeds the ``--draft-topk`` nodes it expands, not one token: on a 2-core Intel
Xeon with AMX the int8 0.5B draft took 57 ms for 1 token and 81 ms for 8 at 800 tokens of
context, so a one-token ratio (0.25) had the cost gates draft more than paid.

With ``--breakdown`` it then times the target's forward part by part over one token and
the verify budget's tokens (linear layers by kind, attention, norms, LM head, the rest), by
module hooks on the wall clock: PyTorch's profiler does not see the project's ctypes
kernels and charges their time to whatever operator it saw last.

Prints tables (median of --reps forwards after one warm-up); no assertions.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from sglang_graft.engine.attention import use_gqa_attention
from sglang_graft.engine.cpu_linear import CPU_KERNEL_MODES, KernelLinear, use_cpu_kernel, wants_cpu_kernel
from sglang_graft.engine.draft_head import DraftHead
from sglang_graft.engine.draft_int8 import INT8_KERNELS, int8_draft, span_reader
from sglang_graft.engine.forward_cost import (
    ForwardTimer,
    breakdown_ms,
    interleaved_ms,
    prefill_ms,
    read_cost,
    verify_costs_flag,
)


def recommended_num_nodes(target_ms: dict[int, float], slack: float) -> int:
    """The largest count ``n >= 2`` whose forward costs at most ``slack`` times one token's
    (2 if none does: speculation then has to win on acceptance alone)."""
    fits = [q for q, ms in target_ms.items() if q >= 2 and ms <= slack * target_ms[1]]
    return max(fits, default=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model folder (transformers format)")
    ap.add_argument("--draft", required=True, help="draft model folder")
    ap.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed forward (default 256)")
    ap.add_argument("--tokens", default="1,2,4,8,12,16,24,32", help="new-token counts to time")
    ap.add_argument(
        "--verify-slack", type=float, default=1.1, help="most a verify may cost, in one-token forwards (default 1.1)"
    )
    ap.add_argument(
        "--verify-tokens", type=int, default=None, help="n whose verify cost the ratio divides by (default: the recommended n)"
    )
    ap.add_argument(
        "--draft-width", type=int, default=8, metavar="W",
        help="tokens per timed draft forward for --draft-cost-ratio: a drafted level feeds --draft-topk nodes "
        "(default 8, generate/bench's default --draft-topk)",
    )
    ap.add_argument(
        "--draft-vocab", type=int, default=0, metavar="K",
        help="time the draft with its LM head cut to the K lowest token ids, as generate/bench --draft-vocab K runs it",
    )
    ap.add_argument(
        "--draft-int8", action="store_true",
        help="time the draft as generate/bench --draft-int8 runs it (int8 matmuls, CPU)",
    )
    ap.add_argument(
        "--int8-kernel", choices=INT8_KERNELS, default="auto",
        help="with --draft-int8, what runs the int8 matmuls, as generate/bench --int8-kernel (default auto)",
    )
    ap.add_argument(
        "--prefill-tokens", type=int, default=512,
        help="prompt length of the draft prefill timed for --draft-read-cost (default 512)",
    )
    ap.add_argument(
        "--cpu-kernel", choices=CPU_KERNEL_MODES, default="auto",
        help="linear layers through the project's AVX2 kernel, as generate/bench --cpu-kernel runs them (default auto)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--breakdown", action="store_true",
        help="last, time the target's forward part by part (linear layers by kind, attention, norms, LM head, "
        "the rest) over 1 token and the verify budget's tokens, to see what a wider verify pays for",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.verify_slack >= 1.0:
        ap.error(f"--verify-slack must be >= 1.0 (a verify never costs less than a decode step), got {args.verify_slack}")
    counts = sorted(
        {*map(int, args.tokens.split(",")), 1, args.draft_width, *([args.verify_tokens] if args.verify_tokens else [])}
    )
    if args.draft_vocab < 0:
        ap.error(f"--draft-vocab must be >= 0 token ids (0: the full head), got {args.draft_vocab}")
    if counts[0] < 1:
        ap.error(f"--tokens, --verify-tokens and --draft-width must be >= 1, got {counts[0]}")
    if args.prefill_tokens < 1:
        ap.error(f"--prefill-tokens must be >= 1, got {args.prefill_tokens}")
    timers: dict[str, ForwardTimer] = {}
    for role, path in (("target", args.target), ("draft", args.draft)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        use_gqa_attention(model)
        if wants_cpu_kernel(args.cpu_kernel, model.dtype, "cpu"):
            use_cpu_kernel(model)
        if role == "draft" and args.draft_int8:
            model = int8_draft(model, args.int8_kernel)
        vocab = int(model.config.get_text_config().vocab_size)
        head = DraftHead(model, args.draft_vocab, [], vocab) if role == "draft" and args.draft_vocab else None
        timers[role] = ForwardTimer(model, args.context, vocab, head)
    ms = interleaved_ms(timers, counts, args.reps)
    draft = timers["draft"]
    # The prompt is read by the int8 draft's bf16 source where that is faster (``span_reader``).
    reader = span_reader(draft.model) or draft.model
    draft_prefill = prefill_ms(reader, args.prefill_tokens, args.reps, draft.vocab, draft.head)
    head_note = f", draft head {args.draft_vocab} ids" if args.draft_vocab else ""
    head_note += ", int8 draft" if args.draft_int8 else ""
    head_note += ", CPU kernel" if isinstance(timers["target"].model.get_output_embeddings(), KernelLinear) else ""
    print(f"dtype={args.dtype} threads={torch.get_num_threads()} context={args.context}{head_note} (median ms per forward)")
    print(f"{'tokens':>7} {'target':>9} {'x 1-token':>10} {'draft':>9}")
    for q in counts:
        print(f"{q:>7} {ms['target'][q]:>9.0f} {ms['target'][q] / ms['target'][1]:>10.2f} {ms['draft'][q]:>9.0f}")
    n = recommended_num_nodes(ms["target"], args.verify_slack)
    print(f"--num-nodes {n}  (the largest n whose verify costs at most {args.verify_slack:g}x a one-token step)")
    verify = args.verify_tokens or n
    width = args.draft_width
    ratio = ms["draft"][width] / ms["target"][verify]
    print(f"--draft-cost-ratio {ratio:.2f}  (draft {width}-token forward / target {verify}-token verify)")
    curve = verify_costs_flag(ms["target"])
    per_token_ratio = ms["draft"][width] / ms["target"][1]
    print(
        f"or: --verify-costs {curve} --num-nodes {max(counts)} --draft-cost-ratio {per_token_ratio:.2f}"
        "  (each round then verifies only the tree width that pays on this host; the ratio is per one-token step)"
    )
    reads = read_cost(draft_prefill, ms["draft"][width], args.prefill_tokens)
    print(
        f"--draft-read-cost {reads:.3f}  (draft prefill of {args.prefill_tokens} tokens: {draft_prefill:.0f} ms, "
        f"i.e. 1 + {args.prefill_tokens} x {reads:.3f} {width}-token draft forwards)"
    )
    if args.breakdown:
        print_breakdown(breakdown_ms(timers["target"], sorted({1, verify}), args.reps))


def print_breakdown(ms: dict[int, dict[str, float]]) -> None:
    """The target's forward part by part (``breakdown_ms``), dearest first at the widest count."""
    counts = sorted(ms)
    widest = ms[counts[-1]]
    print(f"target forward by part (median ms over --reps; {' and '.join(map(str, counts))} tokens):")
    print(f"{'part':>12}" + "".join(f"{f'{q} tok':>9}" for q in counts) + (f"{'diff':>9}" if len(counts) > 1 else ""))
    for part in sorted(widest, key=lambda p: (p == "total", -widest[p])):
        row = [ms[q].get(part, 0.0) for q in counts]
        diff = f"{row[-1] - row[0]:>9.1f}" if len(counts) > 1 else ""
        print(f"{part:>12}" + "".join(f"{v:>9.1f}" for v in row) + diff)


if __name__ == "__main__":
    main()
