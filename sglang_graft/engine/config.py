"""Settings of the reference engine, validated before any model is touched."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_graft.cost import DEFAULT_READ_COST, check_cost_ratio, check_read_cost
from sglang_graft.engine.draft_int8 import INT8_KERNELS
from sglang_graft.prune import GateConfig
from sglang_graft.scheduler import POLICIES, SchedulerConfig

#: Draft forwards one unread prompt token adds for an int8 draft (``draft_int8``): on a
#: 2-core Zen 5 EPYC (``scripts/bench_forward_cost.py --draft-int8 --draft-vocab 32768``,
#: 2026-12-07) the 0.5B draft's bf16 reader took 641 ms over 512 prompt tokens, its int8
#: copy 11-17 ms for a 1-8-token level, so 0.072 a token; charging that instead of the
#: 0.045 measured before the int8 draft's fused layers made graft 2.9% faster over 18
#: Spec-Bench questions (interleaved, 1.540x against 1.497x over ``ar``).
INT8_DRAFT_READ_COST = 0.072

#: ``ar`` is plain decoding (one token per target forward); the rest are scheduler policies.
ENGINE_POLICIES: tuple[str, ...] = ("ar", *POLICIES)


@dataclass(frozen=True)
class EngineConfig:
    """One policy's decoding settings.

    Attributes:
        policy: one of ``ENGINE_POLICIES``.
        num_nodes: verify budget ``n`` (tree nodes incl. the root) of every speculative policy.
        draft_depth: most draft levels per round.
        draft_topk: children per expanded draft node and nodes expanded per level (8: on
            the Intel CPUs measured a draft forward over 8 rows costs what one over 4 does,
            and the wider levels gave 2-3% more tokens per unit of model time; on an AMD
            EPYC where 8 rows cost 18% more, 4 ran 8% faster: see docs/BENCHMARKS.md and
            ``scripts/bench_forward_cost.py``'s draft column).
        draft_vocab: the draft's LM head computes only the rows of the ``draft_vocab``
            lowest token ids and of the batch's prompt tokens (``engine.draft_head``): a
            fifth less time per draft forward for a 0.5B draft at 32768. 0: the full head.
        draft_window: the draft model reads only the last ``draft_window`` tokens of each
            prompt (its prefill then costs at most that many tokens' worth, however long
            the prompt; it drafts from a fresh forward over that window, what StreamingLLM
            calls a sliding window with re-computation), at the price of the draft not
            seeing what lies before it (on Spec-Bench's summaries its tau dropped more than
            the prefill saved). 0: the whole prompt.
        draft_int8: run the draft model's matmuls as dynamic int8 on the CPU, the MLP
            output projections and the LM head excepted (``engine.draft_int8``): about half
            the time per draft forward for a 0.5B draft on 2 cores, with the same top-1
            agreement with the target. Lossless either way (the target verifies); the
            engine quantizes a copy, the loaded draft is left as it was.
        draft_int8_kernel: with ``draft_int8``, what runs the int8 matmuls
            (``engine.draft_int8.INT8_KERNELS``): ``amx`` (AMX tiles, Intel Sapphire Rapids and
            later: a draft forward over 8-20 tokens costs about what one over 1 does), ``vnni``
            (AVX512-VNNI: AMD Zen 4, Intel Cascade Lake and later), ``fbgemm`` (PyTorch's
            dynamic int8 linear), ``auto`` (the first of ``amx``, ``vnni``, ``fbgemm`` that runs).
        gates: confidence gates of ``pruned`` and ``graft``.
        draft_cost_ratio: draft forward time / target forward time for the cost-aware
            depth of ``pruned`` and ``graft`` (see ``sglang_graft.cost``); None: the engine
            estimates it from the two models' weight sizes.
        seed_draft: ``graft`` feeds the round's retrieved nodes to the draft model in its
            first forward (``engine.drafter``): the draft scores them, and drafts below
            them, at almost no extra cost. False: retrieval only fills the tree afterwards.
        continue_drafts: ``graft``: draft nodes per request whose paths the request's own
            context continues where they match it (``SchedulerConfig.continue_drafts``).
            0 (off) by default: on 18 Spec-Bench questions on a CPU, 4 made drafted rounds
            look better to the draft-or-retrieve gate, which then drafted more on
            copy-heavy prompts than the extra tokens paid for (docs/BENCHMARKS.md).
        draft_read_cost: ``graft``: draft forwards one unread prompt token adds, which the
            draft-or-retrieve gate charges before a cold request's first draft (its
            prefill); None: ``INT8_DRAFT_READ_COST`` with ``draft_int8``, else
            ``sglang_graft.cost.DEFAULT_READ_COST`` (``scripts/bench_forward_cost.py``
            measures it). Too low a value prefills the draft on long prompts that retrieval
            alone would copy (6 summarization and RAG questions: 4.9% fewer tokens/s at 0.015
            than at 0.045 with the int8 draft; 18 questions: 2.9% fewer at 0.045 than at 0.072,
            the value measured once the int8 draft's layers were fused).
        compile_core: build trees with the AOTInductor-compiled core (``sglang_graft.compiled``).
        verify_costs: ``(tokens, cost)`` points of a target forward's cost on this host, as
            ``scripts/bench_forward_cost.py`` prints them: every policy but ``dense`` then
            verifies only the tree width that pays (``SchedulerConfig.verify_costs``).
            None: every round verifies all ``num_nodes``.
        online_costs: ``pruned``, ``retrieval`` and ``graft`` with ``verify_costs``: learn
            the verify curve and ``draft_cost_ratio`` from the seconds each round's forwards
            take (``sglang_graft.cost_meter.CostMeter``), starting from the configured
            values (the read cost stays as configured); for hosts whose speed drifts.
            Trees then depend on timing (outputs do not: the target verifies every token);
            the modelled speedup still prices rounds with the configured values.
    """

    policy: str = "graft"
    num_nodes: int = 16
    draft_depth: int = 4
    draft_topk: int = 8
    draft_vocab: int = 0
    draft_window: int = 0
    draft_int8: bool = False
    draft_int8_kernel: str = "auto"
    gates: GateConfig = field(default_factory=GateConfig)
    draft_cost_ratio: float | None = None
    seed_draft: bool = True
    continue_drafts: int = 0
    draft_read_cost: float | None = None
    compile_core: bool = False
    verify_costs: tuple[tuple[int, float], ...] | None = None
    online_costs: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ENGINE_POLICIES:
            raise ValueError(f"policy must be one of {ENGINE_POLICIES}, got {self.policy!r}")
        if self.num_nodes < 2:
            raise ValueError(f"num_nodes (verify budget n) must be >= 2, got {self.num_nodes}")
        if self.draft_depth < 1:
            raise ValueError(f"draft_depth must be >= 1, got {self.draft_depth}")
        if self.draft_topk < 1:
            raise ValueError(f"draft_topk must be >= 1, got {self.draft_topk}")
        if self.draft_window < 0:
            raise ValueError(f"draft_window must be >= 0 prompt tokens (0: the whole prompt), got {self.draft_window}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 token ids (0: the full LM head), got {self.draft_vocab}")
        if self.continue_drafts < 0:
            raise ValueError(f"continue_drafts must be >= 0 draft nodes per request (0: off), got {self.continue_drafts}")
        if self.draft_int8_kernel not in INT8_KERNELS:
            raise ValueError(f"draft_int8_kernel must be one of {INT8_KERNELS}, got {self.draft_int8_kernel!r}")
        check_cost_ratio(self.draft_cost_ratio)
        if self.draft_read_cost is not None:
            check_read_cost(self.draft_read_cost)

    @property
    def uses_draft(self) -> bool:
        return self.policy in ("dense", "pruned", "graft")

    @property
    def uses_retrieval(self) -> bool:
        return self.policy in ("retrieval", "graft")

    def scheduler_config(self) -> SchedulerConfig | None:
        """The scheduler settings of a speculative policy (None for ``ar``)."""
        if self.policy == "ar":
            return None
        return SchedulerConfig(
            policy=self.policy,
            num_nodes=self.num_nodes,
            gates=self.gates,
            draft_cost_ratio=self.draft_cost_ratio,
            draft_depth=self.draft_depth,
            compile_core=self.compile_core,
            verify_costs=self.verify_costs,
            continue_drafts=self.continue_drafts,
            draft_read_cost=self.resolved_read_cost,
        )

    @property
    def resolved_read_cost(self) -> float:
        """``draft_read_cost``, or its default for this draft (see the attribute)."""
        if self.draft_read_cost is not None:
            return self.draft_read_cost
        return INT8_DRAFT_READ_COST if self.draft_int8 else DEFAULT_READ_COST


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy when ``temperature == 0``, else sampling with optional top-p / top-k."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
