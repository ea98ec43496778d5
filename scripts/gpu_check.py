"""Graft's core on the accelerator: same results as on the CPU, and how long each stage takes.

For every batch size x verify budget it builds one synthetic round (EAGLE-shaped drafts,
retrieved chains, a target that agrees with part of the tree), runs gating + pruning,
grafting, packing, greedy and sampled verification, and the SGLang plugin's tree step
(as the worker runs it: on a GPU its core replayed from CUDA graphs; and with
``--graft-eager-core``), once on the CPU and once on the chosen device, and requires every
output to be equal.
Stage times use CUDA events on a GPU (host timers on a CPU). Optionally, when FlashInfer
is importable on a GPU, its tree attention over a grafted mask is compared with PyTorch's
SDPA under the same mask. On a GPU it also captures the round's tensor work (prune, graft,
child links) in a CUDA graph and compares the replay with the eager round, with both times.
Last, retrieval (recycling table on the device, context and history on the host) runs a
synthetic stream on the device and on the CPU, and every proposal must match.

Runs where only torch is installed (no sglang, no transformers):

    python scripts/gpu_check.py [--device auto|cpu|cuda] [--out results.json]

Exit status 1 when any CUDA result differs from the CPU result.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
from collections import defaultdict
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers import simulate_eagle_draft  # noqa: E402
from sglang_graft.candidates import Candidates, Source  # noqa: E402
from sglang_graft.compiled import round_outputs  # noqa: E402
from sglang_graft.graft import graft  # noqa: E402
from sglang_graft.prune import ConfidencePruner, GateConfig, stop_depths  # noqa: E402
from sglang_graft.scheduler import prune_and_graft  # noqa: E402
from sglang_graft.sglang.settings import GraftSettings  # noqa: E402
from sglang_graft.sglang.tree_step import DraftOutputs, TreeBuilder, flatten_draft_steps  # noqa: E402
from sglang_graft.tree import child_links, eagle_candidates, pack  # noqa: E402
from sglang_graft.verify import target_distribution, verify_tree_greedy, verify_tree_sampled  # noqa: E402

TOPK, STEPS, VOCAB = 4, 5, 2000  # 4 + 4 * 16 = 68 draft candidates: enough for n = 64
GATES = GateConfig(root_threshold=0.2, depth_thresholds=((1, 0.2), (4, 0.3)), min_node_score=0.01)
STAGES = ("gate+prune", "graft", "pack", "verify_greedy", "verify_sampled", "plugin_tree_step", "plugin_eager_core")


class _Chains:
    """Retrieval stand-in for the plugin's tree step: the case's chains, clipped to the budget."""

    def __init__(self, chain: Candidates) -> None:
        self.chain = chain

    def propose(self, rids, budget: int | torch.Tensor) -> Candidates:
        c = self.chain
        limit = torch.as_tensor(budget, device=c.tokens.device).view(-1, 1)
        cols = torch.arange(c.width, device=c.tokens.device)
        return Candidates(c.tokens, c.parents, c.scores, c.sources, c.valid & (cols < limit))


def make_case(bs: int, n: int, seed: int) -> dict:
    """One synthetic round on the CPU; the target argmax follows the tree's first children
    with probability 0.7 so verification accepts paths of varied length."""
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(bs, TOPK, STEPS, VOCAB, gen)
    m = n // 2
    chain_tokens = torch.randint(0, VOCAB, (bs, m), generator=gen)
    # Half the requests retrieve a chain that repeats the draft's best first token (merged).
    chain_tokens[: bs // 2, 0] = t[0][: bs // 2, 0]
    chain = Candidates(
        tokens=chain_tokens,
        parents=(torch.arange(m) - 1).expand(bs, m).clone(),
        scores=torch.linspace(0.5, 0.02, m).expand(bs, m).clone(),
        sources=torch.full((bs, m), int(Source.CONTEXT)),
        valid=torch.ones(bs, m, dtype=torch.bool),
    )
    return {
        "bs": bs, "n": n, "score_list": s, "token_list": t, "parents_list": p, "chain": chain,
        "roots": torch.randint(0, VOCAB, (bs,), generator=gen),
        "seq_lens": torch.randint(16, 2048, (bs,), generator=gen),
        "logits": torch.randn(bs, n, VOCAB, generator=gen) * 2,
        "follow": torch.rand(bs, n, generator=gen) < 0.7,
        "uniforms": torch.rand(bs, n, generator=gen),
        "bonus_uniforms": torch.rand(bs, generator=gen),
    }


def _to(x, device: torch.device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    if isinstance(x, Candidates):
        return x.to(device)
    return x


class Timer:
    """Per-stage elapsed milliseconds: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.ms: dict[str, list[float]] = defaultdict(list)

    def run(self, stage: str, fn: Callable[[], object]) -> object:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            self.ms[stage].append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = fn()
            self.ms[stage].append((time.perf_counter() - t0) * 1e3)
        return out


def plugin_builders(case: dict, device: torch.device) -> dict[str, TreeBuilder]:
    """The plugin's tree step as the worker builds it (its core replayed from CUDA graphs
    on a GPU) and with ``--graft-eager-core``; made once per config, as a worker does."""
    chains = _Chains(_to(case["chain"], device))
    return {
        stage: TreeBuilder(GraftSettings(policy="graft", gates=GATES, eager_core=eager), case["n"], TOPK, STEPS,
                           chains, device)
        for stage, eager in (("plugin_tree_step", False), ("plugin_eager_core", True))
    }


def run_round(case: dict, device: torch.device, timer: Timer, builders: dict[str, TreeBuilder]) -> dict[str, torch.Tensor]:
    """Every stage on ``device``; returns all outputs on the CPU."""
    c = {k: _to(v, device) for k, v in case.items()}
    bs, n = c["bs"], c["n"]
    pruner = ConfidencePruner(GATES, device=device)
    drafts = eagle_candidates(c["score_list"], c["token_list"], c["parents_list"], TOPK)

    def gate_and_prune():
        continues = [pruner.step_continues(d + 1, c["score_list"][d]) for d in range(STEPS - 1)]
        return pruner.prune(drafts, stop_depths(continues, bs, device=device))

    pruned = timer.run("gate+prune", gate_and_prune)
    result = timer.run("graft", lambda: graft(c["roots"], [pruned, c["chain"]], n))
    tree = result.tree
    seq_sum = int(case["seq_lens"].sum())
    layout = timer.run("pack", lambda: pack(tree, c["seq_lens"], "full", seq_lens_sum=seq_sum))
    # The target: the first child's token where "follow", else the model's own argmax.
    first_child = layout.retrive_next_token
    child_tok = tree.tokens.gather(1, first_child.clamp(min=0))
    argmax = torch.where(c["follow"] & (first_child >= 0), child_tok, c["logits"].argmax(-1))
    greedy = timer.run(
        "verify_greedy",
        lambda: verify_tree_greedy(tree.tokens, layout.retrive_index, layout.retrive_next_token,
                                   layout.retrive_next_sibling, argmax, n),
    )
    probs = target_distribution(c["logits"], 0.8, top_p=0.95)
    nxt, sib = child_links(tree.parents)
    sampled = timer.run(
        "verify_sampled",
        lambda: verify_tree_sampled(tree.tokens, nxt, sib, probs, c["uniforms"], c["bonus_uniforms"]),
    )
    def plugin_step(builder: TreeBuilder):
        continues = [builder.draft_continues(d + 1, c["score_list"][d]) for d in range(STEPS - 1)]
        flat = flatten_draft_steps(c["score_list"], c["token_list"], c["parents_list"], continues)
        rids = [f"r{i}" for i in range(bs)]
        return builder.build(rids, c["roots"], DraftOutputs.from_flat(*flat, topk=TOPK), c["seq_lens"], "full", seq_sum)

    steps = {stage: timer.run(stage, lambda: plugin_step(b)) for stage, b in builders.items()}
    step = steps["plugin_tree_step"]
    out = {f"tree.{f}": getattr(tree, f) for f in ("tokens", "parents", "depths", "scores", "sources", "bins")}
    out["num_merged"] = result.num_merged
    out.update({f"layout.{k}": v for k, v in layout._asdict().items()})
    out.update({"greedy.predicts": greedy[0], "greedy.accept_index": greedy[1], "greedy.accept_num": greedy[2]})
    out.update({f"sampled.{k}": v for k, v in sampled._asdict().items()})
    out.update({f"plugin.{k}": v for k, v in step.layout._asdict().items()})
    out["plugin.tree.sources"] = step.tree.sources
    out.update({f"plugin_eager.{k}": v for k, v in steps["plugin_eager_core"].layout._asdict().items()})
    return {k: v.detach().cpu() for k, v in out.items()}


def graph_capture_check(case: dict, device: torch.device, reps: int) -> dict:
    """The round's tensor work (``prune_and_graft`` + child links), captured once in a CUDA
    graph and replayed: is the replay equal to the eager round, and how long does each take.

    This is how the SGLang worker would build trees without a kernel launch per op (the
    round has static shapes and no host sync); it is checked here before the worker does it.
    """
    c = {k: _to(v, device) for k, v in case.items()}
    pruner = ConfidencePruner(GATES, device=device)
    drafts = eagle_candidates(c["score_list"], c["token_list"], c["parents_list"], TOPK)
    continues = [pruner.step_continues(d + 1, c["score_list"][d]) for d in range(STEPS - 1)]

    def step() -> tuple[torch.Tensor, ...]:
        return round_outputs(prune_and_graft(pruner, c["roots"], drafts, continues, c["chain"], c["n"]))

    expected = step()  # also fills the index-tensor caches outside the capture
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            captured = step()
    except Exception as exc:  # report, do not fail: the eager round is what runs today
        return {"status": f"capture failed: {type(exc).__name__}: {exc}"}
    graph.replay()
    torch.cuda.synchronize()
    equal = all(torch.equal(a, b) for a, b in zip(expected, captured))
    timer = Timer(device)
    for _ in range(reps):
        timer.run("eager", step)
        timer.run("replay", graph.replay)
    med = {k: sorted(v)[len(v) // 2] for k, v in timer.ms.items()}
    return {"status": "equal" if equal else "mismatch", "eager_ms": med["eager"], "replay_ms": med["replay"]}


def retrieval_check(device: torch.device, batch_sizes: list[int], rounds: int) -> list[dict]:
    """Retrieval on ``device`` against the CPU reference, round for round.

    Three retrievers get the same synthetic stream (``bench_retrieval``'s documents and
    verify rounds, Qwen3's vocabulary): the CPU one as the reference engine runs it (host
    loops up to bs=8, tensor ops above), one on the device with tensor ops only (on the CPU
    itself too, so this also checks the two CPU paths against each other), and one as the
    workers run it: on the host, proposals handed to the device and trees observed from
    there (``output_device``; timed with its copies as ``host_propose``/``host_observe``).
    Every proposal must match (padding columns aside).
    """
    from bench_retrieval import document, target_topk, verify_round  # scripts/ is this script's directory

    from sglang_graft.retrieval import Retriever, RetrieverConfig

    vocab, context, budget = 151_936, 4096, 16
    results = []
    for bs in batch_sizes:
        rng = random.Random(bs)
        pool = [document(rng, 2048, vocab, []) for _ in range(4)]
        docs = [document(rng, context + rounds * (budget + 2) + 64, vocab, pool) for _ in range(bs)]
        rids = [f"check-{i}" for i in range(bs)]
        retrievers = [
            Retriever(RetrieverConfig(vocab_size=vocab)),
            Retriever(RetrieverConfig(vocab_size=vocab, device=str(device), host_loop_max_batch=0)),
            Retriever(RetrieverConfig(vocab_size=vocab, output_device=str(device))),  # what the workers run
        ]
        for r in retrievers:
            for doc in pool:
                r.history.insert(None, doc)
            for rid, doc in zip(rids, docs):
                r.start_request(rid, doc[:context])
        timer = Timer(device)
        gen = torch.Generator().manual_seed(bs)
        pos, differing = [context] * bs, 0
        for _ in range(rounds):
            ref = retrievers[0].propose(rids, budget)
            for name, r in (("", retrievers[1]), ("host_", retrievers[2])):
                got = timer.run(f"{name}propose", lambda: r.propose(rids, budget)).to("cpu")
                differing += not (torch.equal(got.valid, ref.valid) and all(
                    torch.equal(torch.where(ref.valid, getattr(got, f), 0), torch.where(ref.valid, getattr(ref, f), 0))
                    for f in ("tokens", "parents", "scores", "sources", "bins")
                ))
            roots = torch.tensor([d[p - 1] for d, p in zip(docs, pos)])
            truth = torch.tensor([d[p : p + budget + 1] for d, p in zip(docs, pos)])
            tokens, parents, sources, bins, accepted, acc_len = verify_round(ref, roots, truth)
            topk = target_topk(parents, accepted, truth, vocab, gen)
            tree = (tokens, parents, sources, accepted, topk)
            retrievers[0].observe(rids, *tree, tree_bins=bins)
            on_device = _to(list(tree), device), bins.to(device)
            timer.run("observe", lambda: retrievers[1].observe(rids, *on_device[0], tree_bins=on_device[1]))
            timer.run("host_observe", lambda: retrievers[2].observe(rids, *on_device[0], tree_bins=on_device[1]))
            emitted = [d[p : p + n + 1] for d, p, n in zip(docs, pos, acc_len.tolist())]
            for r in retrievers:
                for rid, toks in zip(rids, emitted):
                    r.append(rid, toks)
            pos = [p + len(t) for p, t in zip(pos, emitted)]
        med = {stage: sorted(v)[len(v) // 2] for stage, v in timer.ms.items()}
        results.append(
            {
                "bs": bs,
                "rounds": rounds,
                "differing_rounds": differing,
                "us_per_request_round": {k: round(v * 1e3 / bs, 1) for k, v in med.items()},
                "stats_equal": retrievers[0].stats() == retrievers[1].stats() == retrievers[2].stats(),
            }
        )
    return results


def compare(cpu: dict[str, torch.Tensor], dev: dict[str, torch.Tensor]) -> list[str]:
    """Names of outputs that differ (bit for bit) between the CPU and the device."""
    return [k for k in cpu if cpu[k].shape != dev[k].shape or not torch.equal(cpu[k], dev[k])]


def flashinfer_check(device: torch.device) -> dict:
    """FlashInfer's prefill with a custom (grafted) mask vs SDPA, per request. Optional."""
    if device.type != "cuda":
        return {"status": "skipped", "reason": "needs a CUDA device"}
    try:
        import flashinfer
    except Exception as e:  # absent or broken install: the check is optional
        return {"status": "skipped", "reason": f"flashinfer not importable: {e!r}"}
    case = make_case(bs=2, n=32, seed=7)
    case["seq_lens"] = torch.tensor([100, 257])
    pruner = ConfidencePruner(GATES)
    drafts = eagle_candidates(case["score_list"], case["token_list"], case["parents_list"], TOPK)
    pruned = pruner.prune(drafts, torch.full((2,), 2))
    tree = graft(case["roots"], [pruned, case["chain"]], 32).tree
    layout = pack(tree, case["seq_lens"], "qlen")
    anc = layout.tree_mask.view(2, 32, 32)
    heads, kv_heads, dim = 8, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    errors, t0 = [], time.perf_counter()
    try:
        for b, prefix in enumerate(case["seq_lens"].tolist()):
            kv = prefix + 32
            mask = torch.ones(32, kv, dtype=torch.bool, device="cuda")
            mask[:, prefix:] = anc[b].cuda()
            q = torch.randn(32, heads, dim, device="cuda", dtype=torch.float16, generator=gen)
            k = torch.randn(kv, kv_heads, dim, device="cuda", dtype=torch.float16, generator=gen)
            v = torch.randn(kv, kv_heads, dim, device="cuda", dtype=torch.float16, generator=gen)
            out = flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask)
            rep = heads // kv_heads
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float().transpose(0, 1), k.float().repeat_interleave(rep, 1).transpose(0, 1),
                v.float().repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask,
            ).transpose(0, 1)
            errors.append(float((out.float() - ref).abs().max()))
    except Exception as e:  # JIT build or API failure: reported, not fatal
        return {"status": "error", "reason": repr(e), "seconds": time.perf_counter() - t0}
    ok = max(errors) < 2e-2
    return {"status": "ok" if ok else "mismatch", "max_abs_err": errors, "seconds": time.perf_counter() - t0,
            "version": getattr(flashinfer, "__version__", "?")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds per config (default 20 on GPU, 2 on CPU)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for the reference runs")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if name == "auto" else name)
    reps = args.reps if args.reps is not None else (20 if device.type == "cuda" else 2)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "reps": reps, "configs": []}
    print(f"gpu_check on {info['device']} (torch {torch.__version__}), {reps} timed rounds per config")
    print(f"{'bs':>4} {'n':>4}  " + " ".join(f"{s:>17}" for s in STAGES) + "  (ms, median)  equal")
    failed = False
    for bs in map(int, args.batch_sizes.split(",")):
        for n in map(int, args.budgets.split(",")):
            case = make_case(bs, n, seed=1000 * bs + n)
            cpu = torch.device("cpu")
            reference = run_round(case, cpu, Timer(cpu), plugin_builders(case, cpu))
            builders = plugin_builders(case, device)
            run_round(case, device, Timer(device), builders)  # warm-up (allocator, kernels, graph capture)
            timer = Timer(device)
            for _ in range(reps):
                outputs = run_round(case, device, timer, builders)
            differing = compare(reference, outputs)
            failed |= bool(differing)
            med = {s: sorted(v)[len(v) // 2] for s, v in timer.ms.items()}
            accepted = reference["greedy.accept_num"].float().mean().item()
            print(f"{bs:>4} {n:>4}  " + " ".join(f"{med[s]:>17.3f}" for s in STAGES)
                  + f"  {'yes' if not differing else 'NO: ' + ', '.join(differing)}")
            config = {"bs": bs, "n": n, "median_ms": med, "differing": differing, "mean_greedy_accepted": accepted}
            if device.type == "cuda":
                config["cuda_graph"] = graph_capture_check(case, device, reps)
                print(f"{'':>10}prune+graft+links in a CUDA graph: {config['cuda_graph']}")
                failed |= config["cuda_graph"]["status"] == "mismatch"
            info["configs"].append(config)
    info["retrieval"] = retrieval_check(device, [1, 32], rounds=max(reps, 10))
    for row in info["retrieval"]:
        print(f"retrieval on {device.type} vs the CPU reference: {row}")
        failed |= row["differing_rounds"] > 0 or not row["stats_equal"]
    info["flashinfer"] = flashinfer_check(device)
    print(f"flashinfer tree attention vs SDPA: {info['flashinfer']}")
    failed |= info["flashinfer"]["status"] == "mismatch"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(info, indent=2))
    print("gpu_check:", "FAILED" if failed else "passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
