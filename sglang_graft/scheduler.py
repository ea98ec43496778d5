"""One decode round of Graft, engine-agnostic: gate drafting, prune, retrieve, graft, learn.

Both engines (the transformers reference decoder and the SGLang worker) drive the same
``GraftScheduler``; they differ only in how they draft and verify. The policies compared
in the benchmarks are settings of this one object, all at the same verify budget ``n``:

=============  ===========  ==================  ==========================================
policy         draft model  confidence gates    retrieval
=============  ===========  ==================  ==========================================
``dense``      yes          no                  no (EAGLE's own tree)
``pruned``     yes          yes                 no (freed slots hold filler)
``retrieval``  no           -                   yes
``graft``      yes          yes                 yes, into the slots pruning freed
=============  ===========  ==================  ==========================================

Pruning frees slots in two ways: the gates stop drafting early (and drop draft nodes
below ``min_node_score``), and, because drafted and retrieved nodes are scored in the same
calibrated currency, a retrieved node that is likelier to be accepted than a weak draft
node takes its slot in the best-first selection. Retrieval is therefore asked for up to
``n - 1`` nodes every round and grafting keeps the best ``n - 1`` of everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from sglang_graft.candidates import Candidates
from sglang_graft.compiled import CompiledGate, CompiledRound
from sglang_graft.cost import (
    DEFAULT_READ_COST,
    DepthBudget,
    DraftOrRetrieve,
    RoundRate,
    VerifyCost,
    check_cost_ratio,
    check_read_cost,
)
from sglang_graft.graft import GraftResult, graft, graft_below, trim
from sglang_graft.prune import ConfidencePruner, GateConfig, stop_depths
from sglang_graft.tree import TokenTree

POLICIES = ("dense", "pruned", "retrieval", "graft")


class RetrievalProposer(Protocol):
    """What the scheduler needs from ``sglang_graft.retrieval``."""

    def propose(self, rids: Sequence[str], budget: int) -> Candidates: ...

    def propose_below(self, rids: Sequence[str], tree: TokenTree, anchors: int) -> Candidates | None: ...

    def observe(
        self,
        rids: Sequence[str],
        tree_tokens: torch.Tensor,
        tree_parents: torch.Tensor,
        tree_sources: torch.Tensor,
        accepted_mask: torch.Tensor,
        target_topk: torch.Tensor | None = None,
        *,
        tree_bins: torch.Tensor,
    ) -> None: ...


@dataclass(frozen=True)
class SchedulerConfig:
    """Graft's per-round settings.

    Attributes:
        policy: one of ``POLICIES``.
        num_nodes: the verify budget ``n`` including the root (>= 2).
        gates: confidence-gate settings (used by ``pruned`` and ``graft``).
        draft_cost_ratio: draft forward time / target verify time. When set, the gated
            policies also stop drafting once another level is not expected to raise tokens
            per second (``sglang_graft.cost``); None leaves the depth to the gates alone.
        draft_depth: the drafter's deepest level (the cost look-ahead's horizon).
        compile_core: build each round's tree, and the online gates' estimate and verdict after each
            draft level, with ``sglang_graft.compiled`` (the same code, compiled once per
            shape by AOTInductor on a CPU, captured in a CUDA graph on a GPU) instead of
            eager PyTorch.
        verify_costs: ``(tokens, cost)`` points of what a verify forward costs on this host
            (``sglang_graft.cost.VerifyCost``). When set, every policy but ``dense`` (whose
            tree is EAGLE's own, its scores uncalibrated) verifies only the best ``w <= n``
            nodes of its tree, ``w`` chosen each round so that no slot costs more time than
            its node is expected to give back; costs are then in one-token forwards, and
            ``draft_cost_ratio`` is a draft forward over a one-token target forward. None:
            every round verifies all ``n`` slots (a GPU's verify is flat in ``n``).
        continue_drafts: ``graft`` only: in drafted rounds, the retriever continues the
            paths of each request's ``continue_drafts`` best draft nodes from the request's
            own context where they match it (``Retriever.propose_below``), and those
            continuations compete for the tree's slots too; a copy the draft has begun
            then runs deeper than the draft went. 0: off. It reads the tree back to the
            host once per drafted round.
        draft_read_cost: ``graft`` with a ``draft_cost_ratio``: draft forwards one token the
            drafter has not read yet adds to its next forward (a cold request's prompt), as
            the draft-or-retrieve gate charges it (``DraftOrRetrieve``'s ``read_cost``).
    """

    policy: str = "graft"
    num_nodes: int = 16
    gates: GateConfig = field(default_factory=GateConfig)
    draft_cost_ratio: float | None = None
    draft_depth: int = 8
    compile_core: bool = False
    verify_costs: tuple[tuple[int, float], ...] | None = None
    continue_drafts: int = 0
    draft_read_cost: float = DEFAULT_READ_COST

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.num_nodes < 2:
            raise ValueError(f"num_nodes (verify budget n) must be >= 2, got {self.num_nodes}")
        check_cost_ratio(self.draft_cost_ratio)
        check_read_cost(self.draft_read_cost)
        if self.verify_costs is not None:
            VerifyCost(self.verify_costs)  # raises on a malformed curve
            if self.trims and self.uses_draft and self.draft_cost_ratio is None:
                raise ValueError(
                    f"policy {self.policy!r} with verify_costs needs draft_cost_ratio: the verify width "
                    "weighs slots against the long-run rate, which counts draft forwards"
                )
        if self.draft_depth < 1:
            raise ValueError(f"draft_depth must be >= 1, got {self.draft_depth}")
        if self.continue_drafts < 0:
            raise ValueError(f"continue_drafts must be >= 0 draft nodes per request (0: off), got {self.continue_drafts}")

    @property
    def uses_draft(self) -> bool:
        return self.policy != "retrieval"

    @property
    def uses_gates(self) -> bool:
        return self.policy in ("pruned", "graft")

    @property
    def uses_retrieval(self) -> bool:
        return self.policy in ("retrieval", "graft")

    @property
    def trims(self) -> bool:
        """Whether rounds verify a cost-chosen width of the tree (see ``verify_costs``)."""
        return self.verify_costs is not None and self.policy != "dense"


class GraftScheduler:
    """Builds each round's verify tree and learns from its outcome."""

    def __init__(
        self,
        config: SchedulerConfig,
        retriever: RetrievalProposer | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if config.uses_retrieval and retriever is None:
            raise ValueError(f"policy {config.policy!r} needs a retriever (sglang_graft.retrieval)")
        self.config = config
        self.retriever = retriever
        self.pruner = ConfidencePruner(config.gates, device=device)
        costed = config.uses_gates and config.draft_cost_ratio is not None
        self.depth_budget = DepthBudget(config.draft_cost_ratio, config.draft_depth) if costed else None
        # Skipping the draft altogether needs retrieval to fill the tree instead: graft only.
        self.draft_gate = (
            DraftOrRetrieve(config.draft_cost_ratio, read_cost=config.draft_read_cost)
            if costed and config.uses_retrieval
            else None
        )
        self.verify_cost = VerifyCost(config.verify_costs) if config.verify_costs is not None else None
        # The long-run rate R that verify widths are weighed against (shared with the draft
        # gate when there is one; a policy without drafts never charges the ratio).
        self.rate: RoundRate | None = None
        if config.trims:
            self.rate = self.draft_gate.rate if self.draft_gate is not None else RoundRate(config.draft_cost_ratio or 1.0)
        self.compiled: CompiledRound | None = None
        # Whatever computes the gates' estimates and verdicts: the pruner, or its compiled twin.
        self._gates: ConfidencePruner | CompiledGate = self.pruner
        if config.compile_core:
            self.compiled = CompiledRound(self.pruner if config.uses_gates else None, config.num_nodes)
            if config.uses_gates and config.gates.mode == "online":
                self._gates = CompiledGate(self.pruner)

    def set_costs(self, verify_cost: VerifyCost, draft_cost_ratio: float) -> None:
        """Price the next rounds with new costs (``sglang_graft.cost_meter.CostMeter``'s):
        the verify width, the draft gate, the depth budget and the long-run rate all read
        them from here on (the read cost, in draft forwards, stays as configured). Only a
        policy that trims its trees (``verify_costs`` set) uses a verify curve."""
        if not self.config.trims:
            raise ValueError(f"policy {self.config.policy!r} without verify_costs prices no verify width to update")
        check_cost_ratio(draft_cost_ratio)
        self.verify_cost = verify_cost
        for priced in (self.depth_budget, self.draft_gate, self.rate):
            if priced is not None:
                priced.ratio = draft_cost_ratio

    def draft_continues(self, depth: int, step_scores: torch.Tensor) -> torch.Tensor:
        """After drafting level ``depth``: which requests may draft deeper (``[bs]`` bool).

        Without gates every request continues. With them, a request continues while its
        confidence gates pass and, when a draft cost is configured, while one more level is
        expected to pay for its forward. The engine stops drafting for the whole batch once
        no entry is True.
        """
        bs = step_scores.shape[0]
        gated = self.config.uses_gates and (
            self.depth_budget is not None or self.pruner.config.threshold_at(depth) is not None
        )
        if not gated:
            return torch.ones(bs, dtype=torch.bool, device=step_scores.device)
        q, go_on = self._gates.gate(depth, step_scores)  # one estimate for both tests
        return go_on if self.depth_budget is None else go_on & self.depth_budget.continues(depth, q).to(q.device)

    def retrieve(self, rids: Sequence[str]) -> Candidates | None:
        """This round's retrieved candidates (None for policies without retrieval)."""
        if not self.config.uses_retrieval:
            return None
        assert self.retriever is not None
        return self.retriever.propose(rids, self.config.num_nodes - 1)

    def wants_draft(
        self,
        retrieved: Candidates | None,
        unread: torch.Tensor | None = None,
        cold: torch.Tensor | None = None,
    ) -> bool:
        """Before any draft forward: should the batch draft this round?

        Always for ``dense`` and ``pruned``; for ``graft`` with a draft cost, unless
        retrieval alone is expected to yield more tokens per unit of time for every request
        (``sglang_graft.cost.DraftOrRetrieve``), counting the ``[bs]`` ``unread`` tokens
        each drafter would read first (a prompt it has not prefilled yet); ``cold`` (``[bs]``
        bool) marks the drafters that have read nothing yet.
        """
        if not self.config.uses_draft:
            return False
        if self.draft_gate is None or retrieved is None:
            return True
        slots = self.config.num_nodes - 1
        return bool(self.draft_gate.wants_draft(retrieved.scores, retrieved.valid, slots, unread, cold).any())

    def build_tree(
        self,
        rids: Sequence[str],
        root_tokens: torch.Tensor,
        drafts: Candidates | None,
        continues: list[torch.Tensor] | None = None,
        retrieved: Candidates | None = None,
        seeded: bool = False,
    ) -> GraftResult:
        """The round's tree: the best ``n - 1`` of the pruned drafts and the retrieved nodes.

        Args:
            rids: request ids, one per row.
            root_tokens: ``[bs]`` last verified token per request.
            drafts: the draft model's candidates (raw cumulative probabilities), or None
                when ``wants_draft`` said no.
            continues: the ``draft_continues`` masks of the levels drafted, in order.
            retrieved: this round's ``retrieve`` result, if the caller asked for it
                already (else it is retrieved here).
            seeded: ``drafts`` already hold every retrieved node as a seed the draft model
                scored (``engine.drafter``). Their calibrated draft scores then stand
                alone: grafting the retrieved copies too would give each seed the larger
                of two estimates of one event, which over-predicts (on 18 Spec-Bench
                questions: 299 expected against 203 accepted seed paths, while the draft's
                score alone expected 178 and ranked them better, Brier 0.028 against 0.035;
                the retrieval score alone, 0.088). A seed whose token the draft's head
                cannot score scores 0 (1 of those 1726).
        """
        if self.config.uses_draft and drafts is None and self.draft_gate is None:
            raise ValueError(f"policy {self.config.policy!r} needs draft candidates")
        if self.config.uses_retrieval and retrieved is None:
            retrieved = self.retrieve(rids)
        drafts = drafts if self.config.uses_draft else None
        retrieved = retrieved if self.config.uses_retrieval else None
        grafted = None if seeded and drafts is not None else retrieved
        if self.compiled is not None:
            result = self.compiled.bucketed(root_tokens, drafts, continues or [], grafted, self.config.draft_depth)
        else:
            pruner = self.pruner if self.config.uses_gates else None
            result = prune_and_graft(pruner, root_tokens, drafts, continues or [], grafted, self.config.num_nodes)
        if self.config.continue_drafts and drafts is not None and retrieved is not None:
            assert self.retriever is not None
            below = self.retriever.propose_below(rids, result.tree, self.config.continue_drafts)
            if below is not None:
                grown = graft_below(result.tree, below, self.config.num_nodes)
                result = GraftResult(grown.tree, result.num_merged + grown.num_merged)
        if self.rate is None or self.verify_cost is None:
            return result
        width = self.verify_cost.best_width(result.tree.scores, self.rate.value)
        return GraftResult(trim(result.tree, width), result.num_merged)

    def observe(
        self,
        rids: Sequence[str],
        tree: TokenTree,
        accepted_mask: torch.Tensor,
        target_topk: torch.Tensor | None = None,
        draft_forwards: int | None = None,
    ) -> None:
        """Learn from one verify round.

        Args:
            accepted_mask: ``[bs, n]`` True on the accepted path (root included).
            target_topk: ``[bs, n, k]`` the target's top-k tokens after each node, for
                token recycling (None: recycling learns nothing this round).
            draft_forwards: draft forwards this round took (0 or None: it did not draft).
        """
        tokens = float(accepted_mask.sum()) / max(accepted_mask.shape[0], 1)
        verify_cost = 1.0
        if self.verify_cost is not None:
            verify_cost = self.verify_cost.batch_cost(accepted_mask.shape[0], tree.num_nodes)
        if self.draft_gate is not None and draft_forwards is not None:
            self.draft_gate.observe(tokens, draft_forwards, verify_cost)
        elif self.rate is not None:
            self.rate.observe(tokens, draft_forwards or 0, verify_cost)
        if self.config.uses_gates:
            self.pruner.observe(tree, accepted_mask)
        if self.retriever is not None:
            self.retriever.observe(
                rids, tree.tokens, tree.parents, tree.sources, accepted_mask, target_topk, tree_bins=tree.bins
            )


def prune_and_graft(
    pruner: ConfidencePruner | None,
    root_tokens: torch.Tensor,
    drafts: Candidates | None,
    continues: Sequence[torch.Tensor],
    retrieved: Candidates | None,
    num_nodes: int,
) -> GraftResult:
    """A round's tensor work, host-free: prune the drafts (when gated), then graft them
    and the retrieved nodes into one tree of ``num_nodes``. ``GraftScheduler.build_tree``
    runs it eagerly; ``sglang_graft.compiled`` traces this same function."""
    bs = root_tokens.shape[0]
    device = root_tokens.device
    parts: list[Candidates] = []
    if drafts is not None:
        if pruner is not None:
            drafts = pruner.prune(drafts, stop_depths(list(continues), bs, device=device))
        parts.append(drafts)
    if retrieved is not None:
        parts.append(retrieved)
    if not parts:
        parts.append(Candidates.empty(bs, device))
    return graft(root_tokens, parts, num_nodes)


def accepted_mask_from_nodes(accept_nodes: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``[bs, n]`` bool from accepted node columns ``[bs, k]`` (-1 padded)."""
    bs = accept_nodes.shape[0]
    mask = torch.zeros(bs, num_nodes + 1, dtype=torch.bool, device=accept_nodes.device)
    mask.scatter_(1, torch.where(accept_nodes >= 0, accept_nodes, num_nodes), True)
    return mask[:, :num_nodes]
