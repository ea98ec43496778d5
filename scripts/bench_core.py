"""Microseconds per round for Graft's core: prune + graft + pack.

Synthetic EAGLE draft outputs (topk 4, 5 steps: 68 candidates per request) plus a retrieved
chain per request, at the given batch sizes and verify budgets. Columns: ``eagle`` (EAGLE's
per-step outputs turned into one candidate set, what the SGLang worker does before the
round), ``gates`` (the five per-level confidence gates), ``prune+graft``
(eager ``prune_and_graft``, or with ``--compiled`` the AOTInductor package of the same
code, ``sglang_graft.compiled``, which also compiles the gates' estimate and verdict), ``pack`` (the verify layout, full mask). Prints a table
(median of --reps rounds after --warmup); no assertions: numbers for notes. With
``--compiled`` each new shape is compiled once (about half a minute on 2 cores) and cached.

    .venv/bin/python scripts/bench_core.py [--device cuda] [--threads 1] [--compiled]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from sglang_graft.candidates import Candidates, Source
from sglang_graft.prune import GateConfig
from sglang_graft.scheduler import GraftScheduler, SchedulerConfig, prune_and_graft
from sglang_graft.tree import eagle_candidates, pack


def synthetic_round(bs: int, n: int, topk: int, steps: int, vocab: int, device: str, gen: torch.Generator):
    score_list, token_list, parents_list = [], [], []
    p = torch.softmax(torch.randn(bs, vocab, generator=gen) * 3, -1)
    tp, ti = p.topk(topk, -1)
    scores = tp
    score_list.append(tp.unsqueeze(1))
    token_list.append(ti)
    parents_list.append(torch.arange(-1, topk).expand(bs, topk + 1))
    for i in range(1, steps):
        p = torch.softmax(torch.randn(bs * topk, vocab, generator=gen) * 3, -1)
        tp, ti = p.topk(topk, -1)
        expand = scores.unsqueeze(2) * tp.view(bs, topk, topk)
        cs, ci = expand.flatten(1).topk(topk, -1)
        scores = cs
        score_list.append(expand)
        token_list.append(ti.view(bs, topk * topk))
        parents_list.append(ci + topk * topk * (i - 1) + topk)
    m = n // 2
    chain = Candidates(
        tokens=torch.randint(0, vocab, (bs, m), generator=gen),
        parents=(torch.arange(m) - 1).expand(bs, m).clone(),
        scores=torch.linspace(0.6, 0.05, m).expand(bs, m).clone(),
        sources=torch.full((bs, m), int(Source.CONTEXT)),
        valid=torch.ones(bs, m, dtype=torch.bool),
    )
    move = lambda t: [x.to(device) for x in t]  # noqa: E731
    chain = Candidates(*(getattr(chain, f).to(device) for f in ("tokens", "parents", "scores", "sources", "valid")))
    return move(score_list), move(token_list), move(parents_list), chain


def small_op_us(reps: int = 2000) -> float:
    """Median time of one tiny CPU tensor add: this host's per-op dispatch cost, printed so
    that tables from different (or differently loaded) hosts can be compared."""
    a, b = torch.ones(32), torch.ones(32)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(a, b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--budgets", default="8,16,32,64")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compiled", action="store_true", help="prune+graft through sglang_graft.compiled")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    dev = args.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    topk, steps, vocab = 4, 5, 32000
    mode = "compiled (AOTInductor)" if args.compiled else "eager"
    print(
        f"device={dev} threads={torch.get_num_threads()} topk={topk} steps={steps} {mode} (median us per round; "
        f"one small torch op here: {small_op_us():.1f} us)"
    )
    rows = []
    for bs in map(int, args.batch_sizes.split(",")):
        for n in map(int, args.budgets.split(",")):
            gen = torch.Generator().manual_seed(bs * 1000 + n)
            s, t, p, chain = synthetic_round(bs, n, topk, steps, vocab, dev, gen)
            seq_lens = torch.full((bs,), 512, device=dev)
            roots = torch.zeros(bs, dtype=torch.long, device=dev)
            # The gates and the round as an engine runs them (the ``pruned`` policy's scheduler).
            config = SchedulerConfig("pruned", n, GateConfig(min_node_score=0.02), compile_core=args.compiled)
            scheduler = GraftScheduler(config, device=dev)
            times = {"eagle": [], "gates": [], "prune+graft": [], "pack": []}
            with torch.inference_mode():
                for r in range(args.warmup + args.reps):
                    sync()
                    t0 = time.perf_counter()
                    drafts = eagle_candidates(s, t, p, topk)
                    sync()
                    t05 = time.perf_counter()
                    cont = [scheduler.draft_continues(d + 1, s[d]) for d in range(steps)]
                    sync()
                    t1 = time.perf_counter()
                    if scheduler.compiled is None:
                        tree = prune_and_graft(scheduler.pruner, roots, drafts, cont, chain, n).tree
                    else:
                        tree = scheduler.compiled(roots, drafts, torch.stack(cont, dim=1), chain).tree
                    sync()
                    t2 = time.perf_counter()
                    pack(tree, seq_lens, "full", seq_lens_sum=512 * bs)
                    sync()
                    t3 = time.perf_counter()
                    if r >= args.warmup:
                        times["eagle"].append(t05 - t0)
                        times["gates"].append(t1 - t05)
                        times["prune+graft"].append(t2 - t1)
                        times["pack"].append(t3 - t2)
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            rows.append((bs, n, med))
    print(
        f"{'bs':>4} {'n':>4} {'eagle':>7} {'gates':>7} {'prune+graft':>12} {'pack':>7} "
        f"{'gates..pack':>12} {'us/req':>8}"
    )
    for bs, n, med in rows:
        round_us = med["gates"] + med["prune+graft"] + med["pack"]  # the round proper: EAGLE's outputs excluded
        print(
            f"{bs:>4} {n:>4} {med['eagle']:>7.0f} {med['gates']:>7.0f} {med['prune+graft']:>12.0f} "
            f"{med['pack']:>7.0f} {round_us:>12.0f} {round_us / bs:>8.1f}"
        )


if __name__ == "__main__":
    main()
