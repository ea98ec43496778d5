#!/usr/bin/env python3
"""Compare retrieval settings in seconds: record the target's greedy outputs once, then
replay retrieval-only rounds against them (``sglang_graft.retrieval.replay``).

    # once per model and question set (as long as plain decoding of the questions):
    .venv/bin/python scripts/replay_retrieval.py record --target TARGET \\
        --questions ../shared/data/spec_bench_question.jsonl --per-category 3 --out rec.json
    # then, per setting (seconds):
    .venv/bin/python scripts/replay_retrieval.py replay rec.json --verify-costs 1:87,2:90,4:92,8:107,12:127 \\
        --num-nodes 12 --context-ngram 1 --max-chain 32 --max-occurrences 2

``replay`` prints, per category and overall, tau and tokens per one-token forward of verify
time for the retrieval policy with the given settings and for transformers' prompt lookup
(10 tokens), from the same recordings. Only the verify forwards are counted: prefill,
host work and drafting are not, so the numbers rank settings; the benchmark measures them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sglang_graft.cost import VerifyCost
from sglang_graft.retrieval.replay import Recording, Replayed, replay_prompt_lookup, replay_retrieval
from sglang_graft.retrieval.retriever import RetrieverConfig
from sglang_graft.scheduler import SchedulerConfig

#: Target top-k recorded per output token (the recycling table's width).
RECORDED_K = 8


@torch.inference_mode()
def record(args: argparse.Namespace) -> None:
    """Greedy decoding with the engine's own cache and masks (``PaddedKV``), so the outputs
    are the ones ``--policy ar`` writes; keeps each step's top-k."""
    from tqdm.auto import tqdm

    from sglang_graft.engine.kv import PaddedKV, left_pad
    from sglang_graft.engine.models import prepare_pair
    from sglang_graft.engine.prompts import encode_prompt, load_questions

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = prepare_pair(args.target, None, dtype=args.dtype)
    stop = set(pair.stop_token_ids)
    questions = load_questions(args.questions, args.per_category)
    device = next(pair.target.parameters()).device
    recordings = []
    for q in tqdm(questions, desc="record", unit="prompt"):
        prompt = encode_prompt(pair.tokenizer, q.text)
        kv = PaddedKV(1, device)
        heads, valid = left_pad([prompt[:-1]], 0, device)
        kv.prefill(pair.target, heads, valid)
        root, output, topk = prompt[-1], [], []
        while len(output) < args.max_new_tokens:
            logits = kv.forward(
                pair.target,
                torch.tensor([[root]], device=device),
                kv.lengths.view(1, 1),
                torch.ones(1, 1, 1, dtype=torch.bool, device=device),
            )[0, -1]
            keep = kv.valid.clone()
            keep[:, -1] = True
            kv.commit(keep)
            root = int(logits.max(dim=-1).indices)  # the first maximum, as the engine takes it
            row = [t for t in logits.topk(RECORDED_K).indices.tolist() if t != root][: RECORDED_K - 1]
            output.append(root)
            topk.append([root, *row])
            if root in stop:
                break
        recordings.append({"category": q.category, "prompt": prompt, "output": output, "topk": topk})
    vocab = int(pair.target.config.get_text_config().vocab_size)
    header = {"target": args.target, "vocab_size": vocab, "stop_ids": sorted(stop)}
    Path(args.out).write_text(json.dumps({**header, "recordings": recordings}))
    print(f"wrote {len(recordings)} recordings to {args.out}")


def load(path: str) -> tuple[int, frozenset[int], list[Recording]]:
    """A file ``record`` wrote: vocabulary size, stop ids and recordings (a clear error for
    anything else)."""
    try:
        data = json.loads(Path(path).read_text())
        return data["vocab_size"], frozenset(data["stop_ids"]), [Recording(**r) for r in data["recordings"]]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a file written by 'replay_retrieval.py record' ({type(err).__name__}: {err})")


def replay(args: argparse.Namespace) -> None:
    vocab_size, stop_ids, recordings = load(args.recordings)
    curve = VerifyCost.parse(args.verify_costs)
    retriever = RetrieverConfig(
        vocab_size=vocab_size,
        recycling=not args.no_recycling,
        history=not args.no_history,
        context_ngram=args.context_ngram,
        max_chain=args.max_chain,
        max_occurrences=args.max_occurrences,
    )
    scheduler = SchedulerConfig(policy="retrieval", num_nodes=args.num_nodes, verify_costs=curve.points)
    methods = {
        "retrieval": replay_retrieval(recordings, retriever, scheduler),
        "prompt lookup": [replay_prompt_lookup(r, curve, stop_ids=stop_ids) for r in recordings],
    }
    categories = list(dict.fromkeys(r.category for r in recordings))
    print(f"{'method':14s} {'category':16s} {'tau':>5s} {'verified':>8s} {'tokens/fwd':>10s}")
    for name, results in methods.items():
        for cat in [*categories, "overall"]:
            rows = [r for r in results if cat in ("overall", r.category)]
            total = Replayed(cat, *(sum(getattr(r, f) for r in rows) for f in ("tokens", "rounds", "verified", "cost")))
            print(f"{name:14s} {cat:16s} {total.tau:5.2f} {total.verified / total.rounds:8.1f} {total.tokens / total.cost:10.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="decode the questions greedily and save outputs and top-k")
    rec.add_argument("--target", required=True, help="target model folder, or 'tiny'")
    rec.add_argument("--questions", required=True, help="Spec-Bench-style jsonl (first turns)")
    rec.add_argument("--per-category", type=int, default=3, help="questions per category (default 3)")
    rec.add_argument("--max-new-tokens", type=int, default=128, help="tokens per output (default 128)")
    rec.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    rec.add_argument("--threads", type=int, default=None)
    rec.add_argument("--out", required=True, help="where the recordings go (json)")
    rep = sub.add_parser("replay", help="replay retrieval-only rounds and prompt lookup against recordings")
    rep.add_argument("recordings", help="a file written by 'record'")
    rep.add_argument("--verify-costs", required=True, help="the host's curve, as scripts/bench_forward_cost.py prints it")
    rep.add_argument("--num-nodes", type=int, default=12, help="verify budget n (default 12)")
    defaults = RetrieverConfig(vocab_size=1)
    rep.add_argument("--context-ngram", type=int, default=defaults.context_ngram)
    rep.add_argument("--max-chain", type=int, default=defaults.max_chain)
    rep.add_argument("--max-occurrences", type=int, default=defaults.max_occurrences)
    rep.add_argument("--no-recycling", action="store_true", help="turn the recycling source off")
    rep.add_argument("--no-history", action="store_true", help="turn the history source off")
    args = ap.parse_args(argv)
    try:
        (record if args.command == "record" else replay)(args)
    except (ValueError, OSError) as err:
        sys.exit(f"replay_retrieval: {err}")


if __name__ == "__main__":
    main()
