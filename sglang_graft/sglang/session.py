"""One worker's Graft state across decode rounds, independent of SGLang's objects.

A round is ``begin_round`` (sync the retriever with the batch's requests) -> ``build``
(the verify tree, kept until verify) -> ``finish_round`` (learn from the verify outcome,
report accepted tokens per source). The SGLang worker calls these three around SGLang's
own draft and verify; tests call them with plain tensors and request-like objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from sglang_graft.retrieval import Retriever, RetrieverConfig
from sglang_graft.sglang.feedback import (
    AcceptanceLog,
    accepted_by_source,
    accepted_mask,
    meta_rows,
    target_topk,
)
from sglang_graft.scheduler import RetrievalProposer
from sglang_graft.sglang.request_sync import RequestLike, RequestRetriever, RequestTracker
from sglang_graft.sglang.settings import GraftSettings
from sglang_graft.sglang.tree_step import DraftOutputs, GraftRound, TreeBuilder
from sglang_graft.tree import TokenTree


def make_retriever(settings: GraftSettings, vocab_size: int, device: torch.device | str) -> Retriever | None:
    """The retrieval sources a launch asked for (None when its policy retrieves nothing).

    The history index is fed from SGLang's radix cache (``radix_feed``), not from
    finished requests. Retrieval runs on the host and hands ``device`` each round's
    proposals (``RetrieverConfig.output_device``).
    """
    if settings.policy not in ("graft", "retrieval"):
        return None
    return Retriever(
        RetrieverConfig(
            vocab_size=vocab_size,
            recycling="recycling" in settings.sources,
            context="context" in settings.sources,
            history="history" in settings.sources,
            history_max_tokens=settings.history_max_tokens,
            history_from_finished=False,
            output_device=str(device),
        )
    )


class SessionRetriever(RetrievalProposer, RequestRetriever, Protocol):
    """Retrieval as a session uses it: proposals, learning and per-request state."""


class GraftSession:
    """Tree building, retrieval state and feedback of one worker (one tensor-parallel rank)."""

    def __init__(
        self,
        settings: GraftSettings,
        num_nodes: int,
        topk: int,
        num_steps: int,
        retriever: SessionRetriever | None,
        device: torch.device | str = "cpu",
        recycling_k: int = 0,
    ) -> None:
        """``recycling_k``: target top-k per node handed to retrieval after verify (0: none)."""
        if recycling_k < 0:
            raise ValueError(f"recycling_k must be >= 0 (0: token recycling off), got {recycling_k}")
        self.retriever = retriever
        self.recycling_k = recycling_k
        self.builder = TreeBuilder(settings, num_nodes, topk, num_steps, retriever, device)
        self.requests = None if retriever is None else RequestTracker(retriever)
        self.log = AcceptanceLog(settings.log_interval)
        self._pending: tuple[list[str], TokenTree] | None = None

    @staticmethod
    def for_launch(
        settings: GraftSettings,
        num_nodes: int,
        topk: int,
        num_steps: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> "GraftSession":
        """A session with the retrieval sources the launch's settings ask for."""
        retriever = make_retriever(settings, vocab_size, device)
        k = retriever.config.recycling_k if retriever is not None and retriever.recycling is not None else 0
        return GraftSession(settings, num_nodes, topk, num_steps, retriever, device, recycling_k=k)

    @property
    def num_nodes(self) -> int:
        return self.builder.num_nodes

    def begin_round(self, reqs: Sequence[RequestLike]) -> list[str]:
        """Sync retrieval with this decode batch; returns the request ids in batch order."""
        if self.requests is None:
            return [r.rid for r in reqs]
        return self.requests.sync(reqs)

    def build(
        self,
        rids: Sequence[str],
        bonus_tokens: torch.Tensor,
        drafts: DraftOutputs,
        seq_lens: torch.Tensor,
        mask_mode: str = "full",
        seq_lens_sum: int | None = None,
    ) -> GraftRound:
        """This round's verify tree (remembered until ``finish_round``)."""
        out = self.builder.build(rids, bonus_tokens, drafts, seq_lens, mask_mode, seq_lens_sum)
        self._pending = (list(rids), out.tree)
        return out

    def finish_round(self, accept_index: torch.Tensor, next_token_logits: torch.Tensor | None) -> list[dict[str, int]]:
        """Learn from the verify of the tree last built; returns per-request accepted
        tokens by source.

        Args:
            accept_index: SGLang's ``[bs, max_tree_depth]`` global accepted node indices.
            next_token_logits: the target's ``[bs * n, vocab]`` logits at every node, or
                None (token recycling then learns nothing this round).
        """
        if self._pending is None:
            raise RuntimeError("finish_round called without a tree built by build() this round")
        rids, tree = self._pending
        self._pending = None
        n = tree.num_nodes
        accepted = accepted_mask(accept_index, n)
        topk = None
        if self.recycling_k and next_token_logits is not None:
            topk = target_topk(next_token_logits, tree.batch_size, n, self.recycling_k)
        self.builder.scheduler.observe(rids, tree, accepted, topk)
        counts = accepted_by_source(tree, accepted)
        self.log.add(counts)
        return meta_rows(counts)

    def close_request(self, rid: str) -> None:
        """A request finished: free its retrieval state now rather than at the next round."""
        if self.requests is not None:
            self.requests.close(rid)
