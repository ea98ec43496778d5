"""Confidence pruning: draft only as deep as the draft model is worth trusting.

EAGLE drafts ``spec_steps`` levels for every request and keeps the ``n - 1`` best nodes,
however unsure the draft model is. Following ECHO's gates, each request stops drafting at
the first depth where its best path looks unlikely to be accepted:

* the **root gate**: the best depth-1 proposal (the draft's top-1 probability) is below
  ``root_threshold``: keep depth 1, draft no deeper;
* **depth gates** ``{d: t}``: the best cumulative path probability at depth ``d`` is below
  ``t``: draft no deeper than ``d``.

When every request of the batch is gated, ``step_continues(...).any()`` is False and the
engine skips the remaining draft forwards altogether. Draft nodes below
``min_node_score`` are dropped as well, which frees verify slots for retrieval.

Two modes. ``online`` (the default) maps raw cumulative probabilities through an
``AcceptanceCalibrator`` learned from past verify rounds (per depth and confidence
bucket) before comparing, so thresholds mean "probability the target accepts", the same
for every model, and drafted nodes share one currency with retrieved ones. ``fixed``
compares the draft model's raw cumulative probabilities with the
thresholds (ECHO's per-model constants).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from sglang_graft.calibration import AcceptanceCalibrator, confidence_bins
from sglang_graft.candidates import Candidates, Source
from sglang_graft.graft import summarise_paths
from sglang_graft.tree import TokenTree

GATE_MODES = ("fixed", "online")


@dataclass(frozen=True)
class GateConfig:
    """Pruning settings.

    Attributes:
        mode: ``"fixed"`` (raw draft probabilities) or ``"online"`` (calibrated).
        root_threshold: stop after depth 1 when the best depth-1 score is below this.
        depth_thresholds: ``((depth, threshold), ...)``: stop after ``depth`` when its best
            path score is below ``threshold``.
        min_node_score: drop draft nodes whose (calibrated) path score is below this.
        num_bins: confidence buckets of the online calibration.
        max_depth: deepest draft depth tracked by the calibration (deeper ones share it).
        prior_strength, decay: see ``AcceptanceCalibrator``.
    """

    mode: str = "online"
    root_threshold: float = 0.2
    depth_thresholds: tuple[tuple[int, float], ...] = ((1, 0.2), (4, 0.3))
    min_node_score: float = 0.0
    num_bins: int = 20
    max_depth: int = 16
    prior_strength: float = 8.0
    decay: float = 0.999
    _by_depth: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in GATE_MODES:
            raise ValueError(f"gate mode must be one of {GATE_MODES}, got {self.mode!r}")
        for name in ("root_threshold", "min_node_score"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {v}")
        by_depth: dict[int, float] = {}
        for depth, threshold in self.depth_thresholds:
            if depth < 1:
                raise ValueError(f"gate depth must be >= 1, got {depth}")
            if not 0.0 <= threshold <= 1.0:
                raise ValueError(f"gate threshold at depth {depth} must be in [0, 1], got {threshold}")
            by_depth[depth] = max(by_depth.get(depth, 0.0), threshold)
        if self.max_depth < 1 or self.num_bins < 1:
            raise ValueError(f"max_depth and num_bins must be >= 1, got {self.max_depth} and {self.num_bins}")
        object.__setattr__(self, "_by_depth", by_depth)

    def threshold_at(self, depth: int) -> float | None:
        """The gate threshold after drafting ``depth`` (None: no gate there)."""
        t = self._by_depth.get(depth)
        if depth == 1:
            t = max(t or 0.0, self.root_threshold)
        return t


class ConfidencePruner:
    """Decides per request how deep to draft and which draft nodes survive."""

    def __init__(self, config: GateConfig = GateConfig(), device: torch.device | str = "cpu") -> None:
        self.config = config
        self.calibrator = AcceptanceCalibrator(
            num_groups=config.max_depth + 1,
            num_bins=config.num_bins,
            prior_strength=config.prior_strength,
            decay=config.decay,
            device=device,
        )

    def with_counts(self, proposed: torch.Tensor, accepted: torch.Tensor) -> "ConfidencePruner":
        """This pruner reading the given calibration counts (see ``AcceptanceCalibrator.with_counts``)."""
        twin = copy.copy(self)
        twin.calibrator = self.calibrator.with_counts(proposed, accepted)
        return twin

    def calibrated(self, depths: torch.Tensor | int, raw: torch.Tensor) -> torch.Tensor:
        """Map raw cumulative draft probabilities at ``depths`` (a tensor like ``raw``, or
        one depth for all) to P(path accepted)."""
        if raw.dtype != torch.float32:
            raw = raw.float()
        if self.config.mode == "fixed":
            return raw
        return self.calibrator.estimate_confidence(depths, raw)

    def step_continues(self, depth: int, step_scores: torch.Tensor) -> torch.Tensor:
        """After drafting level ``depth`` (1-based), may each request draft deeper?

        ``step_scores`` is ``[bs, ...]``: the cumulative scores of that level's candidates.
        Returns ``[bs]`` bool. The batch may stop drafting when none is True.
        """
        threshold = self.config.threshold_at(depth)
        if threshold is None:
            return torch.ones(step_scores.shape[0], dtype=torch.bool, device=step_scores.device)
        return self.level_confidence(depth, step_scores) >= threshold

    def level_confidence(self, depth: int | torch.Tensor, step_scores: torch.Tensor) -> torch.Tensor:
        """``[bs]`` calibrated score of each request's best path at level ``depth``."""
        return self.calibrated(depth, step_scores.reshape(step_scores.shape[0], -1).amax(dim=1))

    def passes(self, depth: int, confidence: torch.Tensor) -> torch.Tensor:
        """``step_continues`` from an already computed ``level_confidence``."""
        threshold = self.config.threshold_at(depth)
        return torch.ones_like(confidence, dtype=torch.bool) if threshold is None else confidence >= threshold

    def gate(self, depth: int, step_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(level_confidence, passes)`` after drafting level ``depth``: each request's
        estimate, and whether its gate lets it draft deeper (``[bs]`` each)."""
        confidence = self.level_confidence(depth, step_scores)
        return confidence, self.passes(depth, confidence)

    def prune(self, drafts: Candidates, stop_depth: torch.Tensor) -> Candidates:
        """Keep draft nodes from levels no deeper than each request's ``stop_depth`` ``[bs]``
        (``Candidates.levels``, else depths) and scoring at least ``min_node_score``; scores
        become calibrated and the ``bins`` of draft-sourced nodes the confidence bucket
        (retrieved seeds the draft scored keep their source's bin, which teaches that source)."""
        depth = drafts.depths if drafts.depths is not None else summarise_paths(drafts).depth
        level = depth if drafts.levels is None else drafts.levels
        raw = drafts.scores.float()
        scores = self.calibrated(depth, raw)
        is_draft = drafts.sources == int(Source.DRAFT)
        keep = (
            drafts.valid
            & (level <= stop_depth.view(-1, 1))
            & (scores >= self.config.min_node_score)
        )
        return Candidates(
            tokens=drafts.tokens,
            parents=drafts.parents,
            scores=scores.clamp(0.0, 1.0),
            sources=drafts.sources,
            valid=keep,
            bins=torch.where(is_draft, confidence_bins(raw, self.config.num_bins), drafts.bins),
            depths=depth,
        )

    def observe(self, tree: TokenTree, accepted: torch.Tensor) -> None:
        """Learn from one verify round: ``accepted`` ``[bs, n]`` marks the accepted path.

        Only draft nodes teach the draft calibration; their ``bins`` hold the raw
        confidence bucket recorded by ``prune``.
        """
        is_draft = tree.sources == int(Source.DRAFT)
        self.calibrator.observe(tree.depths[is_draft], tree.bins[is_draft], accepted[is_draft])


def stop_depths(continues: list[torch.Tensor], bs: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[bs]`` deepest level each request may keep, from the per-level continue masks.

    ``continues[d - 1]`` is ``step_continues(d, ...)``; a request stops at the first level
    it may not continue past, or keeps every drafted level.
    """
    depth = torch.full((bs,), len(continues) + 1, dtype=torch.int64, device=device)
    for d in range(len(continues), 0, -1):
        depth = torch.where(continues[d - 1], depth, torch.full_like(depth, d))
    return depth
