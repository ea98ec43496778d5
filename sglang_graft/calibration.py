"""Online calibration: map a proposer's raw confidence to the acceptance rate it earns.

A draft model's cumulative probability is not the probability that the target accepts the
path (draft models are over- or under-confident, and differently at each depth), and a
retrieval match has no probability at all. Grafting compares both kinds of node, so both
are mapped to one currency, P(path accepted), learned from verify outcomes.

Each (group, bin) cell keeps exponentially decayed counts of proposals and acceptances and
reports the posterior mean under a Beta prior centred on the caller's prior guess:
``(accepted + s * prior) / (proposed + s)``. With no observations the estimate is the prior;
with many it is the observed rate. Everything is a tensor op (scatter-add), so observing a
whole batch costs a handful of kernels and is identical on every tensor-parallel rank.
"""

from __future__ import annotations

import copy
from array import array
from collections.abc import Sequence

import torch

from sglang_graft.host_arrays import shared_array


class AcceptanceCalibrator:
    """Decayed Beta-Bernoulli acceptance estimates on a ``[num_groups, num_bins]`` grid.

    Args:
        num_groups: e.g. draft depth buckets, or retrieval sources.
        num_bins: e.g. confidence buckets, or match-length buckets.
        prior_strength: pseudo-count ``s`` given to the prior guess.
        decay: factor in (0, 1] applied to all counts before each ``observe``; 1 keeps
            everything, 0.999 forgets with a half-life of about 700 verify rounds.
    """

    def __init__(
        self,
        num_groups: int,
        num_bins: int,
        prior_strength: float = 8.0,
        decay: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_groups < 1 or num_bins < 1:
            raise ValueError(f"calibration grid must be at least 1x1, got {num_groups}x{num_bins}")
        if prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.num_groups = num_groups
        self.num_bins = num_bins
        self.prior_strength = float(prior_strength)
        self.decay = float(decay)
        cells = num_groups * num_bins
        # Both count vectors in one [2, cells] tensor, so decay is one op; on the CPU its
        # memory is a host array too (proposed, then accepted), for ``observe_cells``.
        self._host_counts: array | None = None
        if torch.device(device).type == "cpu":
            self._host_counts, flat = shared_array("d", 2 * cells, 0.0)
            self._counts: torch.Tensor | None = flat.view(2, cells)
        else:
            self._counts = torch.zeros(2, cells, dtype=torch.float64, device=device)
        self.proposed, self.accepted = self._counts.unbind()
        # ``base + slope * prior`` per cell (see _affine_tables), float32, refreshed in place.
        self._base = torch.zeros(num_groups * num_bins, dtype=torch.float32, device=device)
        self._slope = torch.ones_like(self._base)
        self._stale = False

    def with_counts(self, proposed: torch.Tensor, accepted: torch.Tensor) -> "AcceptanceCalibrator":
        """A calibrator with these settings that reads the given count tensors (not copies).

        A compiled round (``sglang_graft.compiled``) takes the live counts as inputs this
        way, so what it estimates follows every ``observe`` instead of a traced snapshot.
        """
        if proposed.shape != self.proposed.shape or accepted.shape != self.accepted.shape:
            raise ValueError(
                f"calibration counts must have shape {tuple(self.proposed.shape)}, "
                f"got {tuple(proposed.shape)} and {tuple(accepted.shape)}"
            )
        twin = copy.copy(self)
        twin.proposed, twin.accepted, twin._counts, twin._host_counts = proposed, accepted, None, None
        (twin._base, twin._slope), twin._stale = self._tables_from(proposed, accepted), False
        return twin

    def _cells(self, groups: torch.Tensor | int, bins: torch.Tensor) -> torch.Tensor:
        """Cell of each (group, in-range bin); groups are clamped to the grid."""
        if isinstance(groups, int):
            return bins + min(max(groups, 0), self.num_groups - 1) * self.num_bins
        return torch.add(bins, groups.long().clamp(0, self.num_groups - 1), alpha=self.num_bins)

    def _tables_from(self, proposed: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (proposed + self.prior_strength)
        return (accepted * inv).float(), (inv * self.prior_strength).float()

    def _affine_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(base, slope)`` float32 per cell, with the estimate ``base + slope * prior``.

        The posterior mean ``(a + s * prior) / (n + s)`` is affine in the prior; the two
        tables change only in ``observe``, so they are rebuilt once after it rather than on
        every estimate (gates estimate after each draft level). They are rewritten in
        place, so a CUDA graph that captured an estimate reads the current tables, once
        ``refresh_tables`` has run after the last ``observe``.
        """
        if self._stale:
            self.refresh_tables()
        return self._base, self._slope

    def refresh_tables(self) -> None:
        """Rebuild the estimate tables from the counts now (otherwise done lazily)."""
        base, slope = self._tables_from(self.proposed, self.accepted)
        self._base.copy_(base)
        self._slope.copy_(slope)
        self._stale = False

    def estimate(self, groups: torch.Tensor | int, bins: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        """Posterior mean P(accept) per element (same shape as ``prior``, float32).

        ``groups`` is a tensor like ``bins`` or one group for all. Out-of-range groups and
        bins are clamped to the edge cells.
        """
        cells = self._cells(groups, bins.long().clamp(0, self.num_bins - 1))
        base, slope = self._affine_tables()
        return torch.addcmul(base[cells], slope[cells], prior.float()).clamp_(0.0, 1.0)

    def estimate_confidence(self, groups: torch.Tensor | int, confidence: torch.Tensor) -> torch.Tensor:
        """``estimate(groups, confidence_bins(confidence, num_bins), confidence)`` in fewer
        ops (the buckets are in range by construction): the draft gates call it per level."""
        bins = (confidence.clamp(0.0, 1.0) * self.num_bins).long().clamp_(max=self.num_bins - 1)
        cells = self._cells(groups, bins)
        base, slope = self._affine_tables()
        return torch.addcmul(base[cells], slope[cells], confidence).clamp_(0.0, 1.0)

    def observe(self, groups: torch.Tensor, bins: torch.Tensor, accepted: torch.Tensor) -> None:
        """Record one outcome per element: was the proposal accepted."""
        if accepted.numel() == 0:
            return
        self._decay_counts()
        cells = self._cells(groups, bins.long().clamp(0, self.num_bins - 1)).reshape(-1)
        self.proposed.scatter_add_(0, cells, torch.ones_like(cells, dtype=torch.float64))
        self.accepted.scatter_add_(0, cells, accepted.reshape(-1).to(torch.float64))

    def observe_cells(self, cells: Sequence[int], accepted: Sequence[int]) -> None:
        """``observe`` for host loops on a CPU calibrator: one outcome (0 or 1) per cell index
        ``group * num_bins + bin`` (in range). The counts come out bit for bit as ``observe``
        leaves them."""
        counts = self._host_counts
        if counts is None:
            raise RuntimeError("observe_cells needs a calibrator on the CPU; use observe")
        if not cells:
            return
        self._decay_counts()
        offset = len(counts) // 2
        for c, a in zip(cells, accepted):
            counts[c] += 1.0
            counts[offset + c] += a

    def count_lists(self, cells: int) -> tuple[list[float], list[float]]:
        """The first ``cells`` proposed and accepted counts as lists (read from the host
        array on the CPU: no tensor op)."""
        if self._host_counts is None:
            return self.proposed[:cells].tolist(), self.accepted[:cells].tolist()
        offset = len(self._host_counts) // 2
        return self._host_counts[:cells].tolist(), self._host_counts[offset : offset + cells].tolist()

    def _decay_counts(self) -> None:
        """Mark the estimate tables stale and apply one round of decay to the counts."""
        self._stale = True
        if self.decay < 1.0:
            if self._counts is None:  # a ``with_counts`` twin reads two separate tensors
                self.proposed.mul_(self.decay)
                self.accepted.mul_(self.decay)
            else:
                self._counts.mul_(self.decay)

    def rates(self) -> torch.Tensor:
        """Observed acceptance rate per cell, ``[num_groups, num_bins]``, NaN where unseen."""
        r = self.accepted / self.proposed
        return r.reshape(self.num_groups, self.num_bins)

    def counts(self) -> torch.Tensor:
        """Decayed number of observations per cell, ``[num_groups, num_bins]``."""
        return self.proposed.reshape(self.num_groups, self.num_bins).clone()


def confidence_bins(confidence: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Uniform buckets of a probability in [0, 1]: bin ``floor(p * num_bins)``, 1.0 in the top bin."""
    return (confidence.clamp(0.0, 1.0) * num_bins).long().clamp(max=num_bins - 1)
