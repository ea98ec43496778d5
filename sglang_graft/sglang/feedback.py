"""What a verify round teaches Graft, read from SGLang's verify outputs.

SGLang's verify returns ``accept_index`` (``[bs, max_tree_depth]`` global node indices
``b * n + i`` of the accepted path, root first, ``-1`` padded) and the target logits of
every tree node (``[bs * n, vocab]``, tree order). From them: the accepted-path mask the
calibration and retrieval learn from, the target's top-k after every node (token
recycling), and the accepted tokens per source that go into each response's
``meta_info`` and the logs.
"""

from __future__ import annotations

import logging

import torch

from sglang_graft.candidates import SOURCE_NAMES, Source
from sglang_graft.scheduler import accepted_mask_from_nodes
from sglang_graft.tree import TokenTree

logger = logging.getLogger(__name__)

#: Key of the per-round accepted-token counts in a response's ``meta_info``.
META_KEY = "graft_accepted"
#: Sources reported per request (the root is the previous round's token, not a proposal).
REPORTED_SOURCES: tuple[Source, ...] = tuple(s for s in Source if s != Source.ROOT)


def local_accept_nodes(accept_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``[bs, W]`` int64 node columns of the accepted path (``-1`` padded) from SGLang's
    global ``accept_index`` (``b * num_nodes + column``)."""
    bs = accept_index.shape[0]
    base = torch.arange(bs, device=accept_index.device).view(bs, 1) * num_nodes
    idx = accept_index.long()
    local = idx - base
    if bool(((idx >= 0) & ((local < 0) | (local >= num_nodes))).any()):
        raise ValueError(f"accept_index holds a node outside its request's [0, {num_nodes}) block")
    return torch.where(idx >= 0, local, -1)


def accepted_mask(accept_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``[bs, n]`` bool: True on the accepted path (root included)."""
    return accepted_mask_from_nodes(local_accept_nodes(accept_index, num_nodes), num_nodes)


def target_topk(next_token_logits: torch.Tensor, batch_size: int, num_nodes: int, k: int) -> torch.Tensor:
    """``[bs, n, k]`` the target's top-k token ids after every tree node (token recycling)."""
    if next_token_logits.shape[0] != batch_size * num_nodes:
        raise ValueError(
            f"verify logits have {next_token_logits.shape[0]} rows, expected bs*n = {batch_size}*{num_nodes}"
        )
    k = min(k, next_token_logits.shape[-1])
    return next_token_logits.topk(k, dim=-1).indices.view(batch_size, num_nodes, k)


def accepted_by_source(tree: TokenTree, accepted: torch.Tensor) -> torch.Tensor:
    """``[bs, len(Source)]`` int64: accepted proposals of each source (root not counted)."""
    hit = (accepted & (tree.sources != int(Source.ROOT))).long()
    counts = torch.zeros(tree.batch_size, len(Source), dtype=torch.int64, device=tree.tokens.device)
    return counts.scatter_add_(1, tree.sources, hit)


def meta_rows(counts: torch.Tensor) -> list[dict[str, int]]:
    """One ``{source name: accepted tokens}`` dict per request (for ``meta_info``)."""
    table = counts.tolist()
    return [{SOURCE_NAMES[s]: row[s] for s in REPORTED_SOURCES} for row in table]


class AcceptanceLog:
    """Running totals of accepted tokens per source, logged every ``interval`` rounds."""

    def __init__(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"log interval must be >= 0 rounds (0: never), got {interval}")
        self.interval = interval
        self.rounds = 0
        self.totals = [0] * len(Source)

    def add(self, counts: torch.Tensor) -> str | None:
        """Add one round's ``[bs, len(Source)]`` counts; returns the line it logged, if any."""
        for s, v in enumerate(counts.sum(dim=0).tolist()):
            self.totals[s] += v
        self.rounds += 1
        if not self.interval or self.rounds % self.interval:
            return None
        line = self.summary()
        logger.info(line)
        return line

    def summary(self) -> str:
        drafted = self.totals[Source.DRAFT]
        grafted = sum(self.totals[s] for s in REPORTED_SOURCES if s != Source.DRAFT)
        parts = ", ".join(f"{SOURCE_NAMES[s]}={self.totals[s]}" for s in REPORTED_SOURCES)
        return (
            f"graft: {self.rounds} verify rounds, accepted drafted={drafted} grafted={grafted} ({parts})"
        )
