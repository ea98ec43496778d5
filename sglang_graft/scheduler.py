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
from sglang_graft.graft import GraftResult, graft
from sglang_graft.prune import ConfidencePruner, GateConfig, stop_depths
from sglang_graft.tree import TokenTree

POLICIES = ("dense", "pruned", "retrieval", "graft")


class RetrievalProposer(Protocol):
    """What the scheduler needs from ``sglang_graft.retrieval``."""

    def propose(self, rids: Sequence[str], budget: int) -> Candidates: ...

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
    """

    policy: str = "graft"
    num_nodes: int = 16
    gates: GateConfig = field(default_factory=GateConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.num_nodes < 2:
            raise ValueError(f"num_nodes (verify budget n) must be >= 2, got {self.num_nodes}")

    @property
    def uses_draft(self) -> bool:
        return self.policy != "retrieval"

    @property
    def uses_gates(self) -> bool:
        return self.policy in ("pruned", "graft")

    @property
    def uses_retrieval(self) -> bool:
        return self.policy in ("retrieval", "graft")


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

    def draft_continues(self, depth: int, step_scores: torch.Tensor) -> torch.Tensor:
        """After drafting level ``depth``: which requests may draft deeper (``[bs]`` bool).

        Without gates every request continues. The engine stops drafting for the whole
        batch once no entry is True.
        """
        if not self.config.uses_gates:
            return torch.ones(step_scores.shape[0], dtype=torch.bool, device=step_scores.device)
        return self.pruner.step_continues(depth, step_scores)

    def build_tree(
        self,
        rids: Sequence[str],
        root_tokens: torch.Tensor,
        drafts: Candidates | None,
        continues: list[torch.Tensor] | None = None,
    ) -> GraftResult:
        """The round's tree: the best ``n - 1`` of the pruned drafts and the retrieved nodes.

        Args:
            rids: request ids, one per row.
            root_tokens: ``[bs]`` last verified token per request.
            drafts: the draft model's candidates (raw cumulative probabilities), or None.
            continues: the ``draft_continues`` masks of the levels drafted, in order.
        """
        bs = root_tokens.shape[0]
        device = root_tokens.device
        slots = self.config.num_nodes - 1
        parts: list[Candidates] = []
        if self.config.uses_draft:
            if drafts is None:
                raise ValueError(f"policy {self.config.policy!r} needs draft candidates")
            if self.config.uses_gates:
                stop = stop_depths(continues or [], bs, device=device)
                drafts = self.pruner.prune(drafts, stop)
            parts.append(drafts)
        if self.config.uses_retrieval:
            assert self.retriever is not None
            parts.append(self.retriever.propose(rids, slots))
        if not parts:
            parts.append(Candidates.empty(bs, device))
        return graft(root_tokens, parts, self.config.num_nodes)

    def observe(
        self,
        rids: Sequence[str],
        tree: TokenTree,
        accepted_mask: torch.Tensor,
        target_topk: torch.Tensor | None = None,
    ) -> None:
        """Learn from one verify round.

        Args:
            accepted_mask: ``[bs, n]`` True on the accepted path (root included).
            target_topk: ``[bs, n, k]`` the target's top-k tokens after each node, for
                token recycling (None: recycling learns nothing this round).
        """
        if self.config.uses_gates:
            self.pruner.observe(tree, accepted_mask)
        if self.retriever is not None:
            self.retriever.observe(
                rids, tree.tokens, tree.parents, tree.sources, accepted_mask, target_topk, tree_bins=tree.bins
            )


def accepted_mask_from_nodes(accept_nodes: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``[bs, n]`` bool from accepted node columns ``[bs, k]`` (-1 padded)."""
    bs = accept_nodes.shape[0]
    mask = torch.zeros(bs, num_nodes + 1, dtype=torch.bool, device=accept_nodes.device)
    mask.scatter_(1, torch.where(accept_nodes >= 0, accept_nodes, num_nodes), True)
    return mask[:, :num_nodes]
