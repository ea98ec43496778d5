"""``sglang-graft``: one command for the reference engine, the benchmark and the server.

Subcommands:

* ``generate``: decode prompts with one policy on the transformers reference engine;
* ``bench``: every policy and transformers' own baselines side by side on Spec-Bench;
* ``serve``: SGLang's server with Graft switched on (GPU hosts).

Every argument is checked (and the models' paths, configs and tokenizers) before any
weights load; a bad value exits with status 2 and one line naming it and its valid range.
Heavy imports (transformers) happen only inside the subcommand that needs them, so
``--help`` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

EXAMPLES_GENERATE = """examples:
  sglang-graft generate --target tiny --draft tiny --prompt 'def fib(n):'          # seconds, no download
  python scripts/fetch_cpu_models.py          # real Qwen2.5-Coder pair; prints {"target": ..., "draft": ...}
  sglang-graft generate --target TARGET --draft DRAFT --dtype bfloat16 --prompt 'Write quicksort in Python.'
next step: compare every policy with `sglang-graft bench --help`."""

EXAMPLES_BENCH = """results:
  DIR/results.json  {"meta": {...}, "policies": {NAME: {"overall": BLOCK, "categories": {CAT: BLOCK},
                                                        "prompts": [per-prompt tokens, seconds, ...]}}}
                    BLOCK = tau, draft_forwards_per_round, verify_tokens_per_round, tokens_per_s,
                    speedup_vs_ar, speedup_interval ([low, high]: 90% paired bootstrap over the
                    prompts; null below 2), prefill_seconds, decode_tokens_per_s and
                    decode_speedup_vs_ar (the target's prefill excluded: what speculation
                    changes, which on long prompts the prefill hides), modelled_speedup
                    (tokens per one-token target step of modelled decode time: --verify-costs,
                    --draft-cost-ratio, --draft-read-cost; the same on every rerun),
                    accepted_share_by_source, identical_to_ar (share of prompts equal
                    to ar token for token), divergences ([{question_id, position, ar_top2_margin,
                    near_tie}])
  DIR/results.md    the same as tables;  DIR/pareto.png  speedup vs tau per policy
  results.json and results.md are rewritten after every prompt: a run stopped with Ctrl-C
  (exit code 130) keeps the prompts every method finished, marked partial (meta.complete)
example (the README's headline run, about 13 minutes on a 2-core AMD EPYC Zen 5):
  sglang-graft bench --target TARGET --draft DRAFT --questions spec_bench_question.jsonl \\
      --per-category 3 --max-new-tokens 128 --dtype bfloat16 --threads 2 --num-nodes 12 \\
      --draft-depth 4 --draft-topk 4 --draft-vocab 32768 --draft-int8 --verify-costs auto \\
      --online-costs --out bench-out"""


def _positive(kind: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{kind} must be >= 1, got {value}")
        return value

    return parse


def _verify_costs(text: str) -> tuple[tuple[int, float], ...] | str:
    from sglang_graft.cost import VerifyCost

    if text == "auto":
        return text  # measured once the target is loaded (_resolve_verify_costs)
    try:
        return VerifyCost.parse(text).points
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--verify-costs: {err}") from None


def _engine_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``generate`` and ``bench``."""
    from sglang_graft.engine.cpu_linear import CPU_KERNEL_MODES
    from sglang_graft.engine.draft_int8 import INT8_KERNELS

    p.add_argument("--target", required=True, help="target model folder (transformers format), or 'tiny'")
    p.add_argument("--draft", help="draft model folder with the target's tokenizer, or 'tiny' (not needed by ar/retrieval)")
    p.add_argument(
        "--num-nodes",
        type=int,
        default=16,
        help="verify budget n: tree nodes incl. the root (default 16; scripts/bench_forward_cost.py measures the host's)",
    )
    p.add_argument("--draft-depth", type=int, default=4, help="most draft levels per round (default 4)")
    p.add_argument("--draft-topk", type=int, default=8,
                   help="children per expanded draft node, and nodes expanded per level (default 8; where "
                        "scripts/bench_forward_cost.py shows a draft forward over 8 tokens costing clearly more "
                        "than over 4, try 4)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="K",
                   help="the draft's LM head computes only the K lowest token ids (the frequent ones, for "
                        "byte-level BPE tokenizers) and the prompts' tokens: on CPU a fifth less time per "
                        "forward of a 0.5B draft at 32768, lossless (the target still verifies every token); "
                        "lower --draft-cost-ratio to match (default 0: the full head)")
    p.add_argument("--draft-int8", action="store_true",
                   help="CPU: run the draft's matmuls as dynamic int8 (MLP output projections and LM head kept "
                        "as loaded): about half the time per forward of a 0.5B draft on 2 cores, same top-1 "
                        "agreement with the target; lossless (the target verifies). Lower --draft-cost-ratio to "
                        "match (scripts/bench_forward_cost.py --draft-int8 measures it)")
    p.add_argument("--int8-kernel", choices=INT8_KERNELS, default="auto",
                   help="with --draft-int8, what runs the int8 matmuls: amx (AMX tiles, Intel Xeon Sapphire Rapids "
                        "or later: a draft forward over 8-20 tokens then costs about what one over 1 token does), "
                        "vnni (AVX512-VNNI: AMD Zen 4, Intel Cascade Lake or later), both compiled once with g++ "
                        "(~3 s); fbgemm (PyTorch's dynamic int8 linear); auto (default: the first of amx, vnni, "
                        "fbgemm that runs here; the log says when it falls back to fbgemm)")
    p.add_argument("--draft-window", type=int, default=0, metavar="N",
                   help="the draft model reads only the last N tokens of each prompt, which bounds its prefill "
                        "on very long prompts while the target and retrieval still read all of it; lossless, but "
                        "the draft loses what lies before the window (on Spec-Bench's 600-800-token summaries that "
                        "cost more than the prefill saved, docs/BENCHMARKS.md) (default 0: the whole prompt)")
    p.add_argument("--gates", choices=("online", "fixed"), default="online", help="confidence gates: online-calibrated or fixed ECHO thresholds (default online)")
    p.add_argument("--draft-cost-ratio", type=float, default=None,
                   help="draft forward time / target verify forward time (> 0). pruned and graft draft one "
                        "more level only while its expected extra tokens beat the rate decoding has been achieving "
                        "times its cost, and graft skips drafting when the draft adds too little over retrieval "
                        "alone by the same measure (default: the two models' "
                        "weight-size ratio, which underestimates small drafts: measure it, e.g. 0.4 for the "
                        "Qwen2.5-Coder 0.5B/1.5B pair in bf16 on CPU, or let --online-costs learn it)")
    p.add_argument("--draft-read-cost", type=float, default=None, metavar="F",
                   help="graft: draft forwards one unread prompt token adds to the draft's next forward (>= 0), "
                        "which it weighs before prefilling the draft on a request's prompt that retrieval might "
                        "copy instead (default: 0.072 with --draft-int8, else 0.015; "
                        "scripts/bench_forward_cost.py measures it)")
    p.add_argument("--verify-costs", type=_verify_costs, default=None, metavar="T:C,...|auto",
                   help="what a target forward over T tokens costs on this host, e.g. '1:1,8:1.15,16:1.33' "
                        "(scripts/bench_forward_cost.py prints it), or 'auto' to time it on the loaded target "
                        "first (a few seconds; the log shows the values, pass them to reproduce a run): pruned, "
                        "retrieval and graft then verify only as many of their n nodes as are expected to pay "
                        "for the extra verify time, and --draft-cost-ratio is read against a one-token target "
                        "forward (default: every round verifies all n, right where a verify over n tokens costs "
                        "what one token does). With 'auto' and no --draft-cost-ratio, add --online-costs: it "
                        "learns the ratio, which the weights' default prices too low on CPUs")
    p.add_argument("--online-costs", action="store_true",
                   help="pruned, retrieval, graft: keep learning the verify curve and --draft-cost-ratio from "
                        "the time each round's forwards take, starting from the values given (needs "
                        "--verify-costs; 'auto' measures a start; --draft-read-cost stays as given): for hosts "
                        "whose speed drifts while they run. Trees then depend on timing, outputs do not (the "
                        "log prints the learned values as flags)")
    p.add_argument("--no-seed-draft", dest="seed_draft", action="store_false",
                   help="graft: do not feed the retrieved nodes to the draft model (by default its first "
                        "forward scores them and drafts below them, at almost no extra cost)")
    p.add_argument("--continue-drafts", type=int, default=0, metavar="K",
                   help="graft: the request's own context continues the paths of its K best draft nodes where "
                        "they match it for at least 4 tokens, so a copy the draft has begun runs deeper than the "
                        "draft went, at no draft forward; on CPU it made graft draft more on copy-heavy prompts "
                        "than paid (docs/BENCHMARKS.md), so it is off by default (try 4)")
    p.add_argument("--compile-core", action="store_true",
                   help="build each round's tree, and the online gates' estimate and verdict after each draft level, with "
                        "the AOTInductor-compiled core (sglang_graft.compiled): the same code in one native call "
                        "each, 4-8x less tree-building time per round at batch size 1; "
                        "each new shape compiles once (~20-40 s on 2 cores, needs a C++ compiler) and is "
                        "cached under $SGLANG_GRAFT_CACHE (default ~/.cache/sglang-graft): time a bench only "
                        "once the cache is warm")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16", "float64"), default=None,
                   help="model dtype (default: float32 for tiny models, and on CPUs without native bf16 matmul "
                        "when --cpu-kernel is off (there PyTorch's multi-token bf16 forward costs about one forward "
                        "per token); else bfloat16)")
    p.add_argument("--cpu-kernel", choices=CPU_KERNEL_MODES, default="auto",
                   help="run the models' linear layers through the project's CPU kernels (engine/csrc/cpu_linear.cpp, "
                        "AVX2, and bf16_dot_linear.cpp for bf16 on AVX512-BF16 CPUs; compiled once with g++, a few "
                        "seconds): auto (default) uses them on the CPU for float32 models, and for bfloat16 ones where "
                        "the CPU has no AMX (AMD Zen 2/3: an 8-token verify ~5x and a prefill ~10x faster; Zen 4: "
                        "one-token decoding ~1.7x, a 16-token verify ~1.5x faster); on insists (an error says what is "
                        "missing); off keeps PyTorch's own. Unless off, attention over blocks of up to 32 new tokens "
                        "takes small_attention.cpp on CPUs with AVX512 (an 8-token verify's attention ~2.5x faster)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--no-chat-template", action="store_true", help="encode prompts as raw text")


def build_parser() -> argparse.ArgumentParser:
    from sglang_graft.engine.config import ENGINE_POLICIES

    parser = argparse.ArgumentParser(
        prog="sglang-graft",
        description="Graft: prune-then-graft speculative decoding. Start with `sglang-graft generate --help`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{generate,bench,serve}")
    sub.required = True

    g = sub.add_parser(
        "generate",
        help="decode prompts on the reference engine (CPU or CUDA)",
        description="Decode prompts with one policy; prints each text and a one-line summary.",
        epilog=EXAMPLES_GENERATE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _engine_options(g)
    g.add_argument("--policy", choices=ENGINE_POLICIES, default="graft", help="decoding policy (default graft)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", metavar="FILE", help="prompts, one per line (or JSON lines with 'prompt'); decoded as one batch")
    g.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true",
                   help="end stdout with one JSON line: policy, token_ids, text (lists with several prompts), tau, tokens_per_s, ...")

    b = sub.add_parser(
        "bench",
        help="every policy and transformers' baselines side by side",
        description="Spec-Bench first turns (chat template applied), all methods in one process, interleaved per prompt.",
        epilog=EXAMPLES_BENCH,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _engine_options(b)
    b.add_argument("--questions", required=True, metavar="FILE", help="Spec-Bench question.jsonl")
    b.add_argument("--policies", default="ar,dense,pruned,retrieval,graft,hf-assisted,hf-pld",
                   help="comma-separated methods (ar required; hf-assisted, hf-pld are transformers' baselines)")
    b.add_argument("--per-category", type=_positive("--per-category"), default=3, help="questions per category (default 3)")
    b.add_argument("--categories", default=None, metavar="LIST",
                   help="comma-separated categories to run (default all: mt_bench, translation, summarization, "
                        "qa, math_reasoning, rag)")
    b.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=128)
    b.add_argument("--tie-margin", type=float, default=None,
                   help="largest ar top-2 logit margin counted as a numeric near-tie (default by dtype)")
    b.add_argument("--out", required=True, metavar="DIR", help="output folder")

    s = sub.add_parser(
        "serve",
        help="start SGLang's server with Graft (GPU host); extra arguments go to sglang.launch_server",
        description="Start SGLang with --speculative-algorithm GRAFT; all other arguments pass through.",
    )
    s.add_argument("args", nargs=argparse.REMAINDER, help="SGLang server arguments, e.g. --model-path MODEL")
    return parser


def _engine_config(args: argparse.Namespace, policy: str):
    """The engine settings from the flags (``--verify-costs auto`` still unmeasured: None)."""
    from sglang_graft.engine.config import EngineConfig
    from sglang_graft.prune import GateConfig

    if args.online_costs and args.verify_costs is None:
        raise ValueError(
            "--online-costs learns from a starting verify curve: add --verify-costs auto (measured on the "
            "target first) or the curve scripts/bench_forward_cost.py prints"
        )
    return EngineConfig(
        policy=policy,
        num_nodes=args.num_nodes,
        draft_depth=args.draft_depth,
        draft_topk=args.draft_topk,
        draft_vocab=args.draft_vocab,
        draft_window=args.draft_window,
        draft_int8=args.draft_int8,
        draft_int8_kernel=args.int8_kernel,
        gates=GateConfig(mode=args.gates),
        draft_cost_ratio=args.draft_cost_ratio,
        seed_draft=args.seed_draft,
        continue_drafts=args.continue_drafts,
        draft_read_cost=args.draft_read_cost,
        compile_core=args.compile_core,
        verify_costs=None if args.verify_costs == "auto" else args.verify_costs,
        online_costs=args.online_costs,
    )


def _resolve_verify_costs(args: argparse.Namespace, config, target):
    """``config`` with ``--verify-costs auto`` measured on the loaded target."""
    if args.verify_costs != "auto":
        return config
    from sglang_graft.engine.forward_cost import measure_verify_costs

    if config.uses_draft and config.draft_cost_ratio is None and not config.online_costs:
        logging.getLogger("sglang_graft").warning(
            "--verify-costs auto without --draft-cost-ratio prices the draft by its weights' bytes, which "
            "underestimates a small draft (0.135 against a measured 0.24-0.26 for the int8 Qwen2.5-Coder 0.5B/1.5B "
            "pair on a 2-core CPU, docs/BENCHMARKS.md, 'Online costs'): add --online-costs to learn it"
        )
    return dataclasses.replace(config, verify_costs=measure_verify_costs(target, config.num_nodes))


def default_dtype(target: str, device: str, cpu_kernel: str = "auto") -> str:
    """float32 for tiny models, and for CPUs lacking native bf16 GEMM (AVX2-only hosts) when
    the CPU kernel will not run; else bfloat16."""
    import torch

    from sglang_graft.engine.cpu_linear import wants_cpu_kernel

    if target == "tiny":
        return "float32"
    slow_bf16 = device.startswith("cpu") and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if slow_bf16 and not wants_cpu_kernel(cpu_kernel, torch.bfloat16, device):
        return "float32"
    return "bfloat16"


def _setup(args: argparse.Namespace, needs_draft: bool):
    """Threads, dtype and the model pair (validated before loading)."""
    import torch

    from sglang_graft.engine.models import prepare_pair

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if needs_draft and args.draft is None:
        raise ValueError("this policy needs --draft PATH (a model with the target's tokenizer, or 'tiny')")
    dtype = args.dtype or default_dtype(args.target, args.device, args.cpu_kernel)
    pair = prepare_pair(args.target, args.draft, dtype=dtype, device=args.device, cpu_kernel=args.cpu_kernel)
    return pair, dtype


def cmd_generate(args: argparse.Namespace) -> int:
    from sglang_graft.engine.config import SamplingConfig
    from sglang_graft.engine.decoder import SpecEngine
    from sglang_graft.engine.outputs import Totals
    from sglang_graft.engine.prompts import encode_prompt, read_prompt_file

    config = _engine_config(args, args.policy)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    texts = [args.prompt] if args.prompt is not None else read_prompt_file(args.prompts)
    pair, _ = _setup(args, config.uses_draft)
    config = _resolve_verify_costs(args, config, pair.target)
    prompts = [encode_prompt(pair.tokenizer, t, chat=not args.no_chat_template) for t in texts]
    engine = SpecEngine(pair.target, pair.draft, config, stop_token_ids=pair.stop_token_ids)
    engine.check_prompts(prompts, args.max_new_tokens)
    out = engine.generate(prompts, args.max_new_tokens, sampling, seed=args.seed, progress=sys.stderr.isatty())
    totals = Totals()
    decoded = []
    for r in out.requests:
        totals.add(r, 0.0)
        decoded.append(pair.tokenizer.decode(r.token_ids, skip_special_tokens=True))
    totals.seconds = out.elapsed_s
    totals.prefill_s = max((r.prefill_s for r in out.requests), default=0.0)  # one prefill per batch
    for i, text in enumerate(decoded):
        if len(decoded) > 1:
            print(f"--- [{i}]")
        print(text)
    s = totals.summary()
    shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["accepted_share_by_source"].items() if v > 0) or "none"
    print(
        f"[{args.policy}] tau={s['tau']:.2f} tokens/s={s['tokens_per_s']:.2f} tokens={s['tokens']} "
        f"rounds={s['rounds']} draft_forwards/round={s['draft_forwards_per_round']:.2f} "
        f"verify_tokens/round={s['verify_tokens_per_round']:.1f} modelled_speedup={s['modelled_speedup']:.3f} "
        f"accepted by source: {shares}"
    )
    if args.json:
        single = len(out.requests) == 1
        ids = [r.token_ids for r in out.requests]
        record = {
            "policy": args.policy,
            "token_ids": ids[0] if single else ids,
            "text": decoded[0] if single else decoded,
            "tau": s["tau"],
            "tokens_per_s": s["tokens_per_s"],
            "tokens": s["tokens"],
            "rounds": s["rounds"],
            "seconds": out.elapsed_s,
            "prefill_seconds": totals.prefill_s,
            "draft_forwards_per_round": s["draft_forwards_per_round"],
            "verify_tokens_per_round": s["verify_tokens_per_round"],
            "modelled_speedup": s["modelled_speedup"],
            "accepted_share_by_source": s["accepted_share_by_source"],
            "finish_reason": [r.finish_reason for r in out.requests],
        }
        print(json.dumps(record))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from sglang_graft.engine.bench import TIE_MARGINS, BenchRun, BenchSettings, bench_meta, run_bench, summarise
    from sglang_graft.engine.prompts import load_questions
    from sglang_graft.engine.report import write_results
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # assisted generation warns about its own internal call
    methods = tuple(m.strip() for m in args.policies.split(",") if m.strip())
    engine_config = _engine_config(args, "graft")
    dtype_guess = args.dtype or default_dtype(args.target, args.device, args.cpu_kernel)
    tie = args.tie_margin if args.tie_margin is not None else TIE_MARGINS[dtype_guess]
    settings = BenchSettings(methods, args.max_new_tokens, engine_config, tie)
    categories = None if args.categories is None else [c.strip() for c in args.categories.split(",") if c.strip()]
    questions = load_questions(args.questions, args.per_category, categories)
    needs_draft = any(m in ("dense", "pruned", "graft", "hf-assisted") for m in methods)
    pair, dtype = _setup(args, needs_draft)
    settings = dataclasses.replace(settings, engine=_resolve_verify_costs(args, engine_config, pair.target))
    start = time.perf_counter()
    meta = bench_meta(pair, settings, args.questions, dtype)
    meta["categories"] = list(dict.fromkeys(q.category for q in questions))
    done = [0]

    def write(run: BenchRun, plot: bool) -> list[str]:
        # Rewritten after every prompt, so an interrupted run keeps what it measured.
        done[0] = run.prompts_done
        progress = {"prompts_done": run.prompts_done, "prompts": len(questions)}
        progress["complete"] = run.prompts_done == len(questions)
        progress["wall_s"] = round(time.perf_counter() - start, 1)
        return write_results(summarise(run, {**meta, **progress}), args.out, plot=plot)

    try:
        run = run_bench(
            pair, questions, settings, chat=not args.no_chat_template, after_prompt=lambda r: write(r, False)
        )
    except KeyboardInterrupt:
        kept = (f"{os.path.join(args.out, 'results.json')} and results.md hold the {done[0]} of {len(questions)} "
                "prompts every method finished (marked partial)") if done[0] else "no prompt was finished, nothing written"
        print(f"\nsglang-graft bench: interrupted; {kept}", file=sys.stderr)
        return 130
    paths = write(run, True)
    with open(paths[1], encoding="utf-8") as f:
        print(f.read())
    print("wrote " + ", ".join(paths))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from sglang_graft.serve import ServeUnavailable, serve

    try:
        serve(args.args)
    except ServeUnavailable as exc:
        print(f"sglang-graft serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _log_progress() -> None:
    """Show this package's INFO messages (e.g. a one-off core compile) on stderr."""
    logger = logging.getLogger("sglang_graft")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[sglang-graft] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["serve"] and not {"-h", "--help"} & set(argv[1:2]):
        # Everything after ``serve`` belongs to SGLang, options included.
        args = argparse.Namespace(command="serve", args=argv[1:])
    else:
        args = parser.parse_args(argv)
    handler = {"generate": cmd_generate, "bench": cmd_bench, "serve": cmd_serve}[args.command]
    if args.command != "serve":  # SGLang configures logging for its own processes
        _log_progress()
    try:
        return handler(args)
    except ValueError as exc:
        print(f"sglang-graft {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from sglang_graft.compiled import CompileError  # torch is loaded by now

        if not isinstance(exc, CompileError):
            raise
        print(f"sglang-graft {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
