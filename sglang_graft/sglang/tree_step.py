"""The worker's tree-building step, in plain PyTorch: EAGLE's draft outputs in, the
verify-input tensors SGLang expects out.

This is everything the Graft worker adds on the draft side between SGLang's draft
forward and SGLang's verify, kept free of SGLang objects so it runs (and is tested) on
CPU tensors:

1. after each draft level, ``draft_continues`` gates each request (the worker stops the
   batch's remaining draft forwards when no request may continue);
2. ``build`` prunes the drafted candidates, asks retrieval for the freed slots, grafts,
   and packs the tree into SGLang's ``EagleVerifyInput`` layout with exactly
   ``--speculative-num-draft-tokens`` nodes per request.

With policy ``dense`` (or gates that never fire and no retrieval) the result is plain
EAGLE's tree, element for element. Nothing here reads the host clock or a random
generator, so every tensor-parallel rank builds the same tree from the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_graft.candidates import Candidates
from sglang_graft.scheduler import GraftScheduler, RetrievalProposer
from sglang_graft.sglang.settings import GraftSettings
from sglang_graft.tree import TokenTree, VerifyLayout, candidates_from_flat, flatten_eagle_steps, pack


@dataclass(frozen=True)
class DraftOutputs:
    """One round's draft candidates and the gate masks of the levels drafted.

    Attributes:
        candidates: the drafted nodes with raw cumulative draft probabilities.
        continues: ``[bs, L]`` bool, column ``d - 1``: whether each request may draft
            past level ``d`` (``L`` = levels drafted before the last one).
    """

    candidates: Candidates
    continues: torch.Tensor

    @staticmethod
    def from_flat(
        scores: torch.Tensor,
        tokens: torch.Tensor,
        parent_list: torch.Tensor,
        continues: torch.Tensor,
        topk: int,
    ) -> "DraftOutputs":
        """From ``flatten_draft_steps``'s tensors (what the draft CUDA graph returns)."""
        return DraftOutputs(candidates_from_flat(scores, tokens, parent_list, topk), continues.bool())


def flatten_draft_steps(
    score_list: Sequence[torch.Tensor],
    token_list: Sequence[torch.Tensor],
    parents_list: Sequence[torch.Tensor],
    continues: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE's per-level draft outputs and gate masks as four batch-first tensors.

    Only concatenations, no host synchronisation, so it may run inside SGLang's draft
    CUDA graph. Returns ``(scores [bs, m], tokens [bs, m], parent_list [bs, p],
    continues [bs, L])`` for ``DraftOutputs.from_flat``.
    """
    scores, tokens, parent_list = flatten_eagle_steps(score_list, token_list, parents_list)
    if continues:
        gates = torch.stack(list(continues), dim=1)
    else:
        gates = torch.ones(tokens.shape[0], 0, dtype=torch.bool, device=tokens.device)
    return scores, tokens, parent_list, gates


@dataclass(frozen=True)
class GraftRound:
    """One round's verify tree and its SGLang layout."""

    tree: TokenTree
    layout: VerifyLayout
    num_merged: torch.Tensor  # [bs] proposals that repeated another's path


class TreeBuilder:
    """Gates drafting and builds each round's verify tree for one worker.

    Args:
        settings: the launch's Graft settings.
        num_nodes: the verify budget ``n`` (``--speculative-num-draft-tokens``).
        topk: ``--speculative-eagle-topk`` (> 1: a tree).
        num_steps: ``--speculative-num-steps`` (draft levels).
        retriever: the retrieval sources (needed by policies ``graft`` and ``retrieval``).
        device: where gate state and calibration live.
    """

    def __init__(
        self,
        settings: GraftSettings,
        num_nodes: int,
        topk: int,
        num_steps: int,
        retriever: RetrievalProposer | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if topk < 2:
            raise ValueError(f"Graft needs speculative_eagle_topk > 1 to verify a tree, got {topk}")
        if num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {num_steps}")
        self.settings = settings
        self.num_nodes = num_nodes
        self.topk = topk
        self.num_steps = num_steps
        self.scheduler = GraftScheduler(settings.scheduler_config(num_nodes, device), retriever, device=device)

    @property
    def gates_active(self) -> bool:
        return self.scheduler.config.uses_gates

    def draft_continues(self, depth: int, step_scores: torch.Tensor) -> torch.Tensor:
        """``[bs]`` bool after drafting level ``depth``: may each request draft deeper?"""
        return self.scheduler.draft_continues(depth, step_scores)

    def build(
        self,
        rids: Sequence[str],
        bonus_tokens: torch.Tensor,
        drafts: DraftOutputs,
        seq_lens: torch.Tensor,
        mask_mode: str = "full",
        seq_lens_sum: int | None = None,
    ) -> GraftRound:
        """Prune, retrieve, graft and pack one round.

        Args:
            rids: request ids, one per batch row (retrieval state is per request).
            bonus_tokens: ``[bs]`` the last verified token of each request (the root).
            drafts: this round's draft candidates and gate masks.
            seq_lens: ``[bs]`` verified length of each request (the root's position).
            mask_mode: ``"full"`` (FlashInfer/Triton) or ``"qlen"`` (CPU, preallocated QLEN).
            seq_lens_sum: ``seq_lens.sum()`` when known on the host (avoids a sync).
        """
        bs = bonus_tokens.shape[0]
        rows = drafts.candidates.batch_size
        if len(rids) != bs or rows != bs or seq_lens.shape != (bs,):
            raise ValueError(
                f"batch sizes disagree: {len(rids)} rids, {bs} bonus tokens, "
                f"{rows} draft rows, seq_lens {tuple(seq_lens.shape)}"
            )
        result = self.scheduler.build_tree(
            rids, bonus_tokens.long(), drafts.candidates, list(drafts.continues.unbind(1))
        )
        layout = pack(result.tree, seq_lens, mask_mode=mask_mode, seq_lens_sum=seq_lens_sum)
        return GraftRound(result.tree, layout, result.num_merged)
