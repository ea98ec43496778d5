"""The benchmark: every policy and both transformers baselines, side by side, in one process.

Prompts are the outer loop and methods the inner one (their order rotating from prompt
to prompt), so machine drift over the run hits every method alike; figures are ratios of
sums measured in this one run. Each method is warmed up first on throwaway state.

Losslessness is part of the result: for every method, the share of prompts whose greedy
output equals ``ar`` token for token, and for each prompt that differs the first
differing position with the target's top-2 logit margin there in the ``ar`` run. A
divergence whose margin is at most ``tie_margin`` is a numeric near-tie (see README);
anything else is a bug.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from sglang_graft.engine.baselines import BASELINES, HFBaseline
from sglang_graft.engine.config import ENGINE_POLICIES, EngineConfig
from sglang_graft.engine.cpu_linear import KernelLinear
from sglang_graft.engine.decoder import SpecEngine
from sglang_graft.engine.draft_int8 import int8_draft, resolve_int8_kernel
from sglang_graft.engine.models import ModelPair
from sglang_graft.engine.outputs import RequestOutput, Totals
from sglang_graft.engine.prompts import Question, encode_prompt

#: Default near-tie bound per dtype, in logits (see README, "Numerics").
TIE_MARGINS = {"bfloat16": 0.5, "float16": 0.1, "float32": 1e-3, "float64": 1e-9}
#: The paired bootstrap behind each ``speedup_interval``: resamples, coverage, and a fixed
#: seed, so the same records always give the same interval.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_COVERAGE = 0.9
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class BenchSettings:
    methods: tuple[str, ...]
    max_new_tokens: int
    engine: EngineConfig  # tree settings shared by every speculative policy (its policy is ignored)
    tie_margin: float

    def __post_init__(self) -> None:
        valid = (*ENGINE_POLICIES, *BASELINES)
        bad = [m for m in self.methods if m not in valid]
        if bad:
            raise ValueError(f"unknown policies {bad}; valid: {', '.join(valid)}")
        if "ar" not in self.methods:
            raise ValueError("the benchmark needs the 'ar' policy: every speedup and identity is relative to it")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"policies listed twice: {list(self.methods)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.tie_margin < 0:
            raise ValueError(f"tie margin must be >= 0, got {self.tie_margin}")


@dataclass
class Record:
    """One method on one prompt."""

    question: Question
    output: RequestOutput
    seconds: float


@dataclass
class BenchRun:
    settings: BenchSettings
    records: dict[str, list[Record]] = field(default_factory=dict)
    retrieval_stats: dict[str, object] = field(default_factory=dict)
    learned_costs: dict[str, str] = field(default_factory=dict)  # ``online_costs``: the meter's flags so far
    prompts_done: int = 0  # prompts every method has finished


class _Method:
    """A uniform ``run(prompt) -> (output, seconds)`` over engines and baselines."""

    def __init__(self, name: str, pair: ModelPair, settings: BenchSettings) -> None:
        self.name = name
        if name in BASELINES:
            self.baseline: HFBaseline | None = HFBaseline(name, pair.target, pair.draft, pair.stop_token_ids)
            self.engine: SpecEngine | None = None
        else:
            self.baseline = None
            config = dataclasses.replace(settings.engine, policy=name)
            self.engine = SpecEngine(pair.target, pair.draft, config, stop_token_ids=pair.stop_token_ids)

    def run(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[RequestOutput, float]:
        if self.baseline is not None:
            return self.baseline.generate(prompt, max_new_tokens)
        assert self.engine is not None
        out = self.engine.generate([prompt], max_new_tokens)
        return out.requests[0], out.elapsed_s


def run_bench(
    pair: ModelPair,
    questions: Sequence[Question],
    settings: BenchSettings,
    chat: bool = True,
    progress: bool = True,
    after_prompt: Callable[[BenchRun], None] | None = None,
) -> BenchRun:
    """Run every method on every question (first turn), interleaved per prompt.

    ``after_prompt`` sees the run each time every method has finished a prompt (between
    timed runs), so a caller can keep the results so far on disk: an interrupted or
    crashed run then loses at most the prompt it was on.
    """
    prompts = [encode_prompt(pair.tokenizer, q.text, chat) for q in questions]
    # With --draft-int8 our policies share one quantized draft; transformers' baselines keep
    # the loaded one (they are what a user would run today).
    ours = pair
    if settings.engine.draft_int8 and pair.draft is not None:
        ours = dataclasses.replace(pair, draft=int8_draft(pair.draft, settings.engine.draft_int8_kernel))

    def method(name: str) -> _Method:
        return _Method(name, pair if name in BASELINES else ours, settings)

    warm = [method(m) for m in settings.methods]
    for m in warm:  # every prompt fits every engine's models, before the first run
        if m.engine is not None:
            m.engine.check_prompts(prompts, settings.max_new_tokens)
    for m in warm:
        m.run(prompts[0], min(8, settings.max_new_tokens))
    methods = [method(m) for m in settings.methods]
    run = BenchRun(settings, {m.name: [] for m in methods})
    with tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", disable=not progress) as bar:
        for i, (q, p) in enumerate(zip(questions, prompts)):
            order = methods[i % len(methods) :] + methods[: i % len(methods)]
            for m in order:
                bar.set_postfix_str(f"{q.category}/{q.question_id} {m.name}")
                out, seconds = m.run(p, settings.max_new_tokens)
                run.records[m.name].append(Record(q, out, seconds))
                bar.update(1)
            run.prompts_done = i + 1
            for m in methods:
                if m.engine is not None and m.engine.retriever is not None:
                    run.retrieval_stats[m.name] = m.engine.retriever.stats()
                if m.engine is not None and m.engine.meter is not None:
                    run.learned_costs[m.name] = m.engine.meter.flags()
            if after_prompt is not None:
                after_prompt(run)
    return run


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarise(run: BenchRun, meta: dict[str, object]) -> dict[str, object]:
    """The ``results.json`` object (see the CLI's ``bench --help``)."""
    ar = {r.question.question_id: r for r in run.records["ar"]}
    categories = list(dict.fromkeys(r.question.category for r in run.records["ar"]))
    blocks: dict[str, dict[str, object]] = {}
    for name, records in run.records.items():
        groups: dict[str, list[Record]] = {"overall": records}
        for c in categories:
            groups[c] = [r for r in records if r.question.category == c]
        out: dict[str, object] = {}
        for gname, recs in groups.items():
            out[gname] = _block(recs, ar, run.settings.tie_margin)
            refs = [ar[r.question.question_id] for r in recs]
            out[gname]["speedup_interval"] = speedup_interval(
                [(len(r.output.token_ids), r.seconds) for r in recs],
                [(len(r.output.token_ids), r.seconds) for r in refs],
            )
        blocks[name] = out
    for name, out in blocks.items():
        for gname, block in out.items():
            ref = blocks["ar"][gname]
            for rate, key in (("tokens_per_s", "speedup_vs_ar"), ("decode_tokens_per_s", "decode_speedup_vs_ar")):
                block[key] = block[rate] / ref[rate] if ref[rate] else 0.0
    return {
        "meta": meta,
        "policies": {
            name: {
                "overall": out["overall"],
                "categories": {c: out[c] for c in categories},
                "prompts": [_prompt_row(r) for r in run.records[name]],
            }
            for name, out in blocks.items()
        },
        "retrieval_stats": run.retrieval_stats,
        "learned_costs": run.learned_costs,
    }


def speedup_interval(
    runs: Sequence[tuple[int, float]],
    ar_runs: Sequence[tuple[int, float]],
    resamples: int = BOOTSTRAP_RESAMPLES,
    coverage: float = BOOTSTRAP_COVERAGE,
    seed: int = BOOTSTRAP_SEED,
) -> list[float] | None:
    """A percentile bootstrap interval ``[low, high]`` for a speedup over ``ar``.

    ``runs[i]`` and ``ar_runs[i]`` are ``(tokens, seconds)`` of a method and of ``ar`` on
    the same prompt. Each resample draws prompts with replacement and recomputes the
    speedup as the report does (tokens per second over the drawn prompts, the method's over
    ``ar``'s), a drawn prompt counting for both: the interval shows how much a speedup owes
    to which prompts were asked, which decides comparisons on three prompts a category. It
    does not see timing noise within one prompt's run (the interleaved order keeps that
    alike across methods). None for fewer than two prompts or a zero-time draw."""
    if len(runs) != len(ar_runs):
        raise ValueError(f"{len(runs)} runs against {len(ar_runs)} ar runs: they must pair up prompt by prompt")
    if not 0.0 < coverage < 1.0:
        raise ValueError(f"coverage must be in (0, 1), got {coverage}")
    if len(runs) < 2 or resamples < 1:
        return None
    rng = random.Random(seed)
    n = len(runs)
    speedups = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        tokens, seconds = (sum(runs[i][j] for i in picks) for j in (0, 1))
        ar_tokens, ar_seconds = (sum(ar_runs[i][j] for i in picks) for j in (0, 1))
        if min(seconds, ar_seconds, ar_tokens) <= 0:
            return None
        speedups.append((tokens / seconds) / (ar_tokens / ar_seconds))
    speedups.sort()
    tail = (1.0 - coverage) / 2
    low = speedups[max(0, math.floor(tail * resamples))]
    high = speedups[min(resamples - 1, math.ceil((1.0 - tail) * resamples) - 1)]
    return [low, high]


def _prompt_row(r: Record) -> dict[str, object]:
    """One prompt's run as ``results.json`` lists it, for analyses beyond the report's."""
    out = r.output
    return {
        "question_id": r.question.question_id,
        "category": r.question.category,
        "tokens": len(out.token_ids),
        "seconds": r.seconds,
        "prefill_seconds": out.prefill_s,
        "rounds": out.rounds,
        "draft_forwards": out.draft_forwards,
        "verify_tokens": out.verify_tokens,
    }


def _block(records: Sequence[Record], ar: dict[str, Record], tie_margin: float) -> dict[str, object]:
    totals = Totals()
    identical = 0
    divergences = []
    for r in records:
        totals.add(r.output, r.seconds)
        ref = ar[r.question.question_id].output
        pos = _first_difference(r.output.token_ids, ref.token_ids)
        if pos is None:
            identical += 1
            continue
        margin = ref.margins[pos] if pos < len(ref.margins) else None
        divergences.append(
            {
                "question_id": r.question.question_id,
                "category": r.question.category,
                "position": pos,
                "ar_top2_margin": margin,
                "near_tie": margin is not None and margin <= tie_margin,
            }
        )
    block = totals.summary()
    block["prompts"] = len(records)
    block["identical_to_ar"] = identical / len(records) if records else 0.0
    block["divergences"] = divergences
    return block


def bench_meta(pair: ModelPair, settings: BenchSettings, questions_path: str, dtype: str) -> dict[str, object]:
    """What the numbers were measured on, stored with them."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "questions": questions_path,
        "methods": list(settings.methods),
        "max_new_tokens": settings.max_new_tokens,
        "num_nodes": settings.engine.num_nodes,
        "draft_depth": settings.engine.draft_depth,
        "draft_topk": settings.engine.draft_topk,
        "draft_vocab": settings.engine.draft_vocab,
        "draft_window": settings.engine.draft_window,
        "gates": settings.engine.gates.mode,
        "draft_cost_ratio": settings.engine.draft_cost_ratio,
        "draft_read_cost": settings.engine.resolved_read_cost,
        "draft_int8": settings.engine.draft_int8,
        "draft_int8_kernel": resolve_int8_kernel(settings.engine.draft_int8_kernel) if settings.engine.draft_int8 else None,
        "seed_draft": settings.engine.seed_draft,
        "continue_drafts": settings.engine.continue_drafts,
        "verify_costs": settings.engine.verify_costs,
        "online_costs": settings.engine.online_costs,
        "dtype": dtype,
        "cpu_kernel": isinstance(pair.target.get_output_embeddings(), KernelLinear),
        "tie_margin": settings.tie_margin,
        "threads": torch.get_num_threads(),
        "device": str(next(pair.target.parameters()).device),
        "target": type(pair.target).__name__,
        "target_params": sum(p.numel() for p in pair.target.parameters()),
        "draft_params": sum(p.numel() for p in pair.draft.parameters()) if pair.draft is not None else 0,
    }
