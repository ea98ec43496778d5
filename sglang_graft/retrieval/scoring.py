"""One currency for retrieved nodes: calibrated step probabilities, multiplied along a path.

A retrieved node's score must be comparable with a drafted node's: the probability that
the target accepts the whole path down to it. Each retrieval source learns, per bucket of
its raw signal, the rate at which the target accepts one of its nodes *given that the
parent was accepted*; a path's score is the product of those step rates. Because every
factor is at most 1, a child never outscores its parent, so a best-first selection over
the scores is always ancestor-closed.

Buckets (``Candidates.bins``, carried through grafting into the verify tree):

* recycling: the successor's rank in the target's top-k row of its parent;
* context and history: ``length_bucket * NUM_SHARE_BINS + share_bin``, where the length is
  the effective match length (matched suffix + depth along the continuation, since each
  accepted token extends the match) and the share is the fraction of the matched
  occurrences whose continuation passes through this node.

All sources share one ``AcceptanceCalibrator`` whose groups are the sources, so a verify
round costs one ``observe`` call whatever the batch holds.
"""

from __future__ import annotations

import bisect

import torch

from sglang_graft.calibration import AcceptanceCalibrator
from sglang_graft.candidates import Source

#: Lower bounds of the match-length buckets (a length below 1 never occurs).
LENGTH_BOUNDS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: Buckets of the share of occurrences that agree on a continuation token.
NUM_SHARE_BINS = 3
#: Number of calibration bins a context or history node can fall in.
NUM_MATCH_BINS = len(LENGTH_BOUNDS) * NUM_SHARE_BINS

#: The retrieval sources, in the order of their calibration groups.
RETRIEVAL_SOURCES: tuple[Source, ...] = (Source.RECYCLING, Source.CONTEXT, Source.HISTORY)
_TRASH_GROUP = len(RETRIEVAL_SOURCES)  # receives every outcome that teaches no retrieval source

#: History matches come from other requests, so their prior is discounted against context.
_HISTORY_PRIOR_FACTOR = 0.75


def length_bucket(length: int) -> int:
    """Bucket of an effective match length (``>= 1``)."""
    return bisect.bisect_right(LENGTH_BOUNDS, length) - 1


#: ``length_bucket(n) * NUM_SHARE_BINS`` for every length up to the last bound (a list
#: lookup is several times cheaper than a bisect on the per-node scoring path).
_BIN_BASE: tuple[int, ...] = tuple(length_bucket(n) * NUM_SHARE_BINS for n in range(LENGTH_BOUNDS[-1] + 1))
_TOP_BIN_BASE = _BIN_BASE[-1]


def match_bin(length: int, share: float) -> int:
    """Calibration bin of a context/history node: effective match length x agreement share."""
    share_bin = int(share * NUM_SHARE_BINS)
    if share_bin >= NUM_SHARE_BINS:
        share_bin = NUM_SHARE_BINS - 1
    return (_BIN_BASE[length] if length <= LENGTH_BOUNDS[-1] else _TOP_BIN_BASE) + share_bin


def rank_prior(rank: int) -> float:
    """Prior step rate of a recycled successor: the target's top-1 is right often, lower ranks rarely."""
    return 0.4 / (rank + 1)


def match_prior(bin_index: int) -> float:
    """Prior step rate of a context node in ``bin_index``: longer matches and wider agreement rate higher."""
    length = LENGTH_BOUNDS[bin_index // NUM_SHARE_BINS]
    share = (bin_index % NUM_SHARE_BINS + 0.5) / NUM_SHARE_BINS
    return length / (length + 6.0) * share


class RetrievalCalibration:
    """Per-source, per-bucket step acceptance rates learned from verify outcomes.

    Args:
        rank_k: width of the recycling table (its number of rank buckets).
        prior_strength, decay: see ``AcceptanceCalibrator``.
        device: where the verify tensors handed to ``observe`` live.
    """

    def __init__(self, rank_k: int, prior_strength: float, decay: float, device: torch.device | str) -> None:
        if rank_k < 1:
            raise ValueError(f"rank_k must be >= 1, got {rank_k}")
        num_bins = max(rank_k, NUM_MATCH_BINS)
        self.rank_k = rank_k
        self.calibrator = AcceptanceCalibrator(
            len(RETRIEVAL_SOURCES) + 1, num_bins, prior_strength=prior_strength, decay=decay, device=device
        )
        prior = torch.full((len(RETRIEVAL_SOURCES) + 1, num_bins), 0.5, dtype=torch.float64)
        prior[0, :rank_k] = torch.tensor([rank_prior(r) for r in range(rank_k)], dtype=torch.float64)
        match = torch.tensor([match_prior(b) for b in range(NUM_MATCH_BINS)], dtype=torch.float64)
        prior[1, :NUM_MATCH_BINS] = match
        prior[2, :NUM_MATCH_BINS] = match * _HISTORY_PRIOR_FACTOR
        self.prior = prior[: len(RETRIEVAL_SOURCES)]
        self._prior_list = self.prior.reshape(-1).tolist()
        group_of = torch.full((len(Source),), _TRASH_GROUP, dtype=torch.int64)
        for g, s in enumerate(RETRIEVAL_SOURCES):
            group_of[int(s)] = g
        self._group_of_source = group_of.to(device)
        self._cell_offset_of_source: list[int] = (group_of * num_bins).tolist()
        self._num_bins = num_bins
        self._counts: tuple[list[float], list[float]] | None = None  # host copy of the calibrator's counts
        self._step: list[list[float] | None] = [None] * len(RETRIEVAL_SOURCES)

    def step_probabilities(self) -> dict[Source, list[float]]:
        """Current calibrated step rate per bin, for each retrieval source."""
        return {s: self.step_rates(s) for s in RETRIEVAL_SOURCES}

    def step_rates(self, source: Source) -> list[float]:
        """Current calibrated step rate per bin of one retrieval source.

        This is the calibrator's posterior mean ``(accepted + s * prior) / (proposed + s)``
        (what ``AcceptanceCalibrator.estimate`` returns, cell by cell), evaluated on the
        host: the proposal paths are host loops over a small grid, and reading two count
        vectors costs far fewer tensor operations than a batched estimate on every round.
        The counts are read once per ``observe`` and each source's rates are computed only
        when asked for (a source with nothing to propose never needs them).
        """
        g = RETRIEVAL_SOURCES.index(source)
        rates = self._step[g]
        if rates is None:
            if self._counts is None:
                self._counts = self.calibrator.count_lists(len(self._prior_list))
            proposed, accepted = self._counts
            s = self.calibrator.prior_strength
            cells = range(g * self._num_bins, g * self._num_bins + (self.rank_k if g == 0 else self._num_bins))
            prior = self._prior_list
            rates = self._step[g] = [(accepted[c] + s * prior[c]) / (proposed[c] + s) for c in cells]
        return rates

    def observe(
        self,
        parents: torch.Tensor,
        sources: torch.Tensor,
        bins: torch.Tensor,
        accepted: torch.Tensor,
    ) -> None:
        """Learn from one verified tree batch (all ``[bs, n]``, column 0 the root).

        A retrieved node teaches its source's bin only when its parent was accepted (the
        root always counts as accepted): that is exactly the conditional step rate the
        scores multiply. Every other node goes to a group no source reads, which keeps
        the update free of data-dependent shapes (no host sync on a GPU).
        """
        parent_accepted = accepted.gather(1, parents.clamp(min=0)) | (parents == 0)
        groups = torch.where(parent_accepted, self._group_of_source[sources], _TRASH_GROUP)
        self.calibrator.observe(groups, bins, accepted)
        self._forget_rates()

    def observe_rows(
        self,
        parents: list[list[int]],
        sources: list[list[int]],
        bins: list[list[int]],
        accepted: list[list[bool]],
    ) -> None:
        """``observe`` on host lists (a CPU calibration only), with the same result: one
        Python pass over the nodes is far cheaper than a dozen tensor ops on small batches."""
        # Cells as the calibrator computes them (group * num_bins + bin, bins clamped),
        # with the group's offset looked up per source.
        top_bin = self.calibrator.num_bins - 1
        offset_of, trash = self._cell_offset_of_source, _TRASH_GROUP * self.calibrator.num_bins
        cells: list[int] = []
        outcomes: list[bool] = []
        for row_parents, row_sources, row_bins, row_accepted in zip(parents, sources, bins, accepted):
            for p, s, b, a in zip(row_parents, row_sources, row_bins, row_accepted):
                offset = offset_of[s] if p == 0 or row_accepted[p if p > 0 else 0] else trash
                cells.append(offset + (b if 0 <= b <= top_bin else (0 if b < 0 else top_bin)))
                outcomes.append(a)
        self.calibrator.observe_cells(cells, outcomes)
        self._forget_rates()

    def _forget_rates(self) -> None:
        """Drop the host copies of the counts and rates after the counts moved."""
        self._counts = None
        self._step = [None] * len(RETRIEVAL_SOURCES)
