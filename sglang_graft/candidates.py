"""Proposed tree nodes, the common currency between drafting, retrieval and grafting.

Every proposer (the draft model's top-k expansion, token recycling, the context index,
the history index) hands the grafting step the same thing: a batch of small forests
hanging off the current root token, one node per column, each with an estimate of the
probability that the target accepts the whole path from the root down to it. Grafting
then never needs to know where a node came from, only what it is worth.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Source(enum.IntEnum):
    """Where a tree node came from; stored per node as int64 and reported per source."""

    ROOT = 0
    DRAFT = 1
    RECYCLING = 2
    CONTEXT = 3
    HISTORY = 4
    FILLER = 5


#: Lower-case names used in logs, metrics and reports, indexed by ``Source`` value.
SOURCE_NAMES: tuple[str, ...] = tuple(s.name.lower() for s in Source)


@dataclass(frozen=True)
class Candidates:
    """A batch of proposed nodes, ``m`` columns per request.

    Attributes:
        tokens:  ``[bs, m]`` int64 token ids.
        parents: ``[bs, m]`` int64; ``-1`` hangs the node under the root (the last verified
            token), otherwise the column ``j < i`` of its parent in this same set.
        scores:  ``[bs, m]`` float32 estimate of P(the whole root-to-node path is accepted).
        sources: ``[bs, m]`` int64 ``Source`` codes.
        valid:   ``[bs, m]`` bool; invalid columns are padding and are ignored (so are
            their descendants).
        bins:    ``[bs, m]`` int64 calibration bucket of the proposer's raw signal (draft:
            confidence bucket; context/history: match-length bucket; recycling: rank
            bucket). It travels into the tree so that, after verify, each proposer can
            learn which of its buckets the target accepts. ``None`` means all zeros.
        depths:  optional ``[bs, m]`` int64 depth below the root (1 for its children), for
            proposers that know it by construction; ``None`` when not given.
        levels:  optional ``[bs, m]`` int64, for draft candidates: the draft level (1 for
            the first forward) that proposed the node, which the depth gates cut at; when
            a draft starts from retrieved nodes, a level-1 node can lie deeper than 1.
            ``None``: the level is the depth.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    sources: torch.Tensor
    valid: torch.Tensor
    bins: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    levels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bins is None:
            object.__setattr__(self, "bins", torch.zeros_like(self.tokens, dtype=torch.int64))

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def to(self, device: torch.device | str) -> "Candidates":
        """The same candidates on ``device`` (itself when already there)."""
        if self.tokens.device == torch.device(device):
            return self
        return Candidates(*(None if t is None else t.to(device) for t in (
            self.tokens, self.parents, self.scores, self.sources, self.valid, self.bins, self.depths, self.levels)))

    @staticmethod
    def empty(batch_size: int, device: torch.device | str = "cpu") -> "Candidates":
        """No proposals for any request (a dry source)."""
        z = torch.zeros(batch_size, 0, dtype=torch.int64, device=device)
        return Candidates(z, z.clone(), z.float(), z.clone(), z.bool(), z.clone(), z.clone())

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first malformed field."""
        shape = self.tokens.shape
        if self.tokens.dim() != 2:
            raise ValueError(f"Candidates.tokens must be [bs, m], got shape {tuple(shape)}")
        for name in ("parents", "scores", "sources", "valid", "bins"):
            t = getattr(self, name)
            if t.shape != shape:
                raise ValueError(
                    f"Candidates.{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like tokens"
                )
        if self.width == 0:
            return
        v = self.valid
        toks = self.tokens[v]
        if toks.numel() and int(toks.min()) < 0:
            raise ValueError(f"Candidates.tokens holds negative token id {int(toks.min())}")
        if vocab_size is not None and toks.numel() and int(toks.max()) >= vocab_size:
            raise ValueError(
                f"Candidates.tokens holds token id {int(toks.max())}, outside the vocabulary [0, {vocab_size})"
            )
        cols = torch.arange(self.width, device=self.tokens.device)
        if bool(((self.parents >= cols) & v).any()) or bool(((self.parents < -1) & v).any()):
            raise ValueError("Candidates.parents must be -1 (root) or the column of an earlier node")
        sc = self.scores[v]
        if sc.numel() and (bool(torch.isnan(sc).any()) or float(sc.min()) < 0 or float(sc.max()) > 1):
            raise ValueError("Candidates.scores must be probabilities in [0, 1] with no NaN")


def concat_candidates(parts: list[Candidates]) -> Candidates:
    """Concatenate candidate sets column-wise, shifting parent columns so they stay valid."""
    if not parts:
        raise ValueError("concat_candidates needs at least one Candidates")
    sizes = [p.batch_size for p in parts]
    if len(set(sizes)) != 1:
        raise ValueError(f"candidate sets disagree on batch size: {sizes}")
    offset = 0
    parents = []
    for p in parts:
        parents.append(torch.where(p.parents >= 0, p.parents + offset, p.parents))
        offset += p.width
    return Candidates(
        tokens=torch.cat([p.tokens for p in parts], dim=1),
        parents=torch.cat(parents, dim=1),
        scores=torch.cat([p.scores for p in parts], dim=1),
        sources=torch.cat([p.sources for p in parts], dim=1),
        valid=torch.cat([p.valid for p in parts], dim=1),
        bins=torch.cat([p.bins for p in parts], dim=1),
        depths=None if any(p.depths is None for p in parts) else torch.cat([p.depths for p in parts], dim=1),
    )
