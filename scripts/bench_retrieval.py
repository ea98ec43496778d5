"""Benchmark the retrieval layer: time per request per decode round, and memory per structure.

Each configuration (batch size x context length x history size) opens ``bs`` requests whose
prompts are synthetic documents (fresh tokens, copies of their own earlier spans, and
spans shared with the history documents, so every source finds matches), then runs decode
rounds: ``propose`` -> a verify tree of the root plus every proposed node -> greedy
acceptance against the document's true continuation -> ``observe`` (with the target's top-k
as ``target_topk`` simulates it) -> ``append`` of the accepted tokens plus the bonus. Only the three retrieval
calls are timed; building the tree and simulating the target are not. Columns: the median
microseconds per request per round of each call, their sum (``total``), and the mean of the
per-round sums (``mean``: it also counts the rare slow rounds, such as a rebuilt recycling
template, that throughput pays and medians hide).

    python scripts/bench_retrieval.py                      # the default grid (a few minutes)
    python scripts/bench_retrieval.py --bs 1 --context 32768 --history 0 1000000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from sglang_graft.candidates import Candidates, Source
from sglang_graft.retrieval import Retriever, RetrieverConfig
from sglang_graft.tree import depths_from_parents


def document(rng: random.Random, length: int, vocab: int, pool: list[list[int]]) -> list[int]:
    """Synthetic text: fresh runs, copies of its own earlier spans, and spans of pool documents."""
    out: list[int] = []
    while len(out) < length:
        r = rng.random()
        if out and r < 0.25:
            start = rng.randrange(len(out))
            out.extend(out[start : start + rng.randint(8, 64)])
        elif pool and r < 0.35:
            src = pool[rng.randrange(len(pool))]
            start = rng.randrange(len(src))
            out.extend(src[start : start + rng.randint(8, 64)])
        else:
            out.extend(rng.randrange(vocab) for _ in range(rng.randint(4, 32)))
    return out[:length]


def verify_round(c: Candidates, roots: torch.Tensor, truth: torch.Tensor):
    """The tree (root + every candidate column) and its greedy acceptance against ``truth`` [bs, d]."""
    bs, m = c.tokens.shape
    v = c.valid
    tokens = torch.cat([roots.view(bs, 1), torch.where(v, c.tokens, 0)], dim=1)
    parents = torch.cat([torch.full((bs, 1), -1), torch.where(v, c.parents + 1, 0)], dim=1)
    sources = torch.cat([torch.full((bs, 1), int(Source.ROOT)), torch.where(v, c.sources, int(Source.FILLER))], dim=1)
    bins = torch.cat([torch.zeros(bs, 1, dtype=torch.int64), torch.where(v, c.bins, 0)], dim=1)
    accepted = torch.zeros(bs, m + 1, dtype=torch.bool)
    accepted[:, 0] = True
    depth = torch.zeros(bs, m + 1, dtype=torch.int64)
    rows = torch.arange(bs)
    for i in range(1, m + 1):
        p = parents[:, i]
        depth[:, i] = depth[rows, p] + 1
        want = truth.gather(1, (depth[:, i] - 1).clamp(max=truth.shape[1] - 1).view(bs, 1)).view(bs)
        accepted[:, i] = accepted[rows, p] & v[:, i - 1] & (tokens[:, i] == want)
    accepted_len = (depth * accepted).max(dim=1).values
    return tokens, parents, sources, bins, accepted, accepted_len


def target_topk(
    parents: torch.Tensor, accepted: torch.Tensor, truth: torch.Tensor, vocab: int, gen: torch.Generator | None = None
) -> torch.Tensor:
    """``[bs, n, 8]`` the target's top-8 after every node of a ``verify_round`` tree, as a
    verify pass reports it: after an accepted node at depth ``d`` the document's next token
    ``truth[:, d]`` is the top-1 (what greedy decoding emits there); the other ranks, and
    every rank after a rejected node, are random ids. The recycling table thus learns the
    document's real successors where a real target's top-1 would teach them."""
    bs, n = accepted.shape
    topk = torch.randint(0, vocab, (bs, n, 8), generator=gen)
    depth = depths_from_parents(parents).clamp(max=truth.shape[1] - 1)
    topk[:, :, 0] = torch.where(accepted, truth.gather(1, depth), topk[:, :, 0])
    return topk


def run_config(
    r: Retriever, rng: random.Random, bs: int, ctx: int, args: argparse.Namespace, pool: list[list[int]]
) -> dict[str, float]:
    vocab = args.vocab
    docs = [document(rng, ctx + args.rounds * (args.budget + 2) + 64, vocab, pool) for _ in range(bs)]
    rids = [f"bench-{bs}-{ctx}-{i}" for i in range(bs)]
    t0 = time.perf_counter()
    for rid, doc in zip(rids, docs):
        r.start_request(rid, doc[:ctx])
    start_s = time.perf_counter() - t0
    pos = [ctx] * bs
    memory = r.memory_bytes()
    timings: dict[str, list[float]] = {"propose": [], "observe": [], "append": []}
    round_totals: list[float] = []  # propose + observe + append of each round: its mean shows the rare slow rounds
    accepted_total = 0
    for round_ in range(args.warmup + args.rounds):
        roots = torch.tensor([d[p - 1] for d, p in zip(docs, pos)])
        truth = torch.tensor([d[p : p + args.budget + 1] for d, p in zip(docs, pos)])
        t0 = time.perf_counter_ns()
        c = r.propose(rids, args.budget)
        t1 = time.perf_counter_ns()
        c = Candidates(*(t.cpu() for t in (c.tokens, c.parents, c.scores, c.sources, c.valid, c.bins)))
        tokens, parents, sources, bins, accepted, acc_len = verify_round(c, roots, truth)
        topk = target_topk(parents, accepted, truth, vocab)
        tree = [t.to(r.device) for t in (tokens, parents, sources, accepted, topk, bins)]
        t2 = time.perf_counter_ns()
        r.observe(rids, *tree[:5], tree_bins=tree[5])
        t3 = time.perf_counter_ns()
        emitted = [d[p : p + n + 1] for d, p, n in zip(docs, pos, acc_len.tolist())]
        t4 = time.perf_counter_ns()
        for rid, toks in zip(rids, emitted):
            r.append(rid, toks)
        t5 = time.perf_counter_ns()
        pos = [p + len(t) for p, t in zip(pos, emitted)]
        if round_ >= args.warmup:
            timings["propose"].append((t1 - t0) / 1e3 / bs)
            timings["observe"].append((t3 - t2) / 1e3 / bs)
            timings["append"].append((t5 - t4) / 1e3 / bs)
            round_totals.append(((t1 - t0) + (t3 - t2) + (t5 - t4)) / 1e3 / bs)
            accepted_total += int(acc_len.sum())
    for rid in rids:
        r.abort_request(rid)
    med = {k: statistics.median(v) for k, v in timings.items()}
    return {
        **med,
        "total": med["propose"] + med["observe"] + med["append"],
        "mean": statistics.mean(round_totals),
        "tau": 1 + accepted_total / (args.rounds * bs),
        "start_ms": start_s * 1e3 / bs,
        "mem_recycling": memory["recycling"],
        "mem_context": memory["context"] / bs,
        "mem_history": memory["history"],
    }


def op_overhead_us(n: int = 20_000) -> float:
    """Median cost of one trivial tensor op here: on small batches retrieval is bound by the
    number of tensor ops, so this is the yardstick to read the table against."""
    x = torch.ones(16)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n // 5):
            x.add(1)
        samples.append((time.perf_counter_ns() - t0) / 1e3 / (n // 5))
    return statistics.median(samples)


def loop_step_ns(n: int = 200_000) -> float:
    """Median cost of one trivial Python loop step here (an append): the yardstick for the
    host-loop rounds that small CPU batches run (``host_loop_max_batch``)."""
    samples = []
    for _ in range(5):
        out: list[int] = []
        t0 = time.perf_counter_ns()
        for i in range(n // 5):
            out.append(i)
        samples.append((time.perf_counter_ns() - t0) / (n // 5))
    return statistics.median(samples)


def yardsticks() -> str:
    return f"one small torch op = {op_overhead_us():.1f} us, one Python loop step = {loop_step_ns():.0f} ns"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 32], help="batch sizes")
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 32768], help="prompt lengths (tokens)")
    ap.add_argument("--history", type=int, nargs="+", default=[0, 1_000_000], help="history sizes (tokens)")
    ap.add_argument("--vocab", type=int, default=151_936, help="vocabulary size (Qwen3 by default)")
    ap.add_argument("--budget", type=int, default=16, help="nodes proposed per request per round")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1000,
        help="timed rounds per configuration (enough that every row meets copied spans: with 200, a "
        "seed can land in a stretch of fresh tokens where nothing is proposed and the row times idle rounds)",
    )
    ap.add_argument("--warmup", type=int, default=20, help="untimed rounds first")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's default); retrieval tensors are tiny, extra threads only contend",
    )
    ap.add_argument(
        "--host-loop-max-batch",
        type=int,
        default=RetrieverConfig.host_loop_max_batch,
        help="CPU batches up to this size run as host loops instead of tensor ops (0: never)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name, low in (("rounds", 1), ("warmup", 0), ("budget", 1), ("vocab", 2)):
        if getattr(args, name) < low:
            ap.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    for name, low in (("bs", 1), ("context", 1), ("history", 0)):
        bad = [v for v in getattr(args, name) if v < low]
        if bad:
            ap.error(f"--{name} values must be >= {low}, got {bad}")
    if args.threads:
        torch.set_num_threads(args.threads)

    rng = random.Random(args.seed)
    pool = [document(rng, 2048, args.vocab, []) for _ in range(16)]
    print(
        f"retrieval benchmark: vocab={args.vocab} budget={args.budget} rounds={args.rounds} "
        f"device={args.device} torch_threads={torch.get_num_threads()}; "
        f"{yardsticks()}; host loops up to bs={args.host_loop_max_batch}"
    )
    header = (
        f"{'bs':>3} {'context':>7} {'history':>9} | {'propose':>8} {'observe':>8} {'append':>7} {'total':>8} {'mean':>7}"
        f" | {'tau':>5} {'start/req':>9} | {'recycling':>9} {'context/req':>11} {'history':>9}"
    )
    print(header)
    print(f"{'':>21} | {'us/req/round':^43} | {'':>5} {'ms':>9} | {'MB':>9} {'MB':>11} {'MB':>9}")
    print("-" * len(header))
    for hist in args.history:
        r = Retriever(
            RetrieverConfig(
                vocab_size=args.vocab,
                history_max_tokens=max(hist, 1),
                device=args.device,
                host_loop_max_batch=args.host_loop_max_batch,
            )
        )
        t0 = time.perf_counter()
        filled = 0
        while filled < hist:
            doc = document(rng, min(4096, hist - filled), args.vocab, pool)
            r.history.insert(None, doc)
            filled += len(doc)
        fill_s = time.perf_counter() - t0
        for bs in args.bs:
            for ctx in args.context:
                s = run_config(r, rng, bs, ctx, args, pool)
                print(
                    f"{bs:>3} {ctx:>7} {hist:>9} | {s['propose']:>8.1f} {s['observe']:>8.1f} {s['append']:>7.1f}"
                    f" {s['total']:>8.1f} {s['mean']:>7.1f} | {s['tau']:>5.2f} {s['start_ms']:>9.1f} |"
                    f" {s['mem_recycling'] / 2**20:>9.2f} {s['mem_context'] / 2**20:>11.2f}"
                    f" {s['mem_history'] / 2**20:>9.2f}",
                    flush=True,
                )
                if s["tau"] == 1.0:
                    print("    (nothing was accepted in this row: its rounds timed idle lookups; raise --rounds)")
        if hist:
            print(f"    (history of {hist} tokens filled in {fill_s:.1f} s)")
    print(f"{yardsticks()} (again, after the grid)")


if __name__ == "__main__":
    main()
