"""Forward costs learned from the forwards a run times, for hosts whose speed drifts.

The cost-aware choices (``sglang_graft.cost``) price a verify over ``w`` tokens with a
curve and a draft forward with a ratio, both measured beforehand. On some hosts the right
values move while a run goes on: a 2-core Zen 5 EPYC alternated, minutes apart, between a
phase where a one-token target step took 74 ms and a 12-token verify 115 (1.55x) and one
where they took 90 and 105 (1.17x). A curve measured in one phase then prices the other's
trees wrongly: too narrow in the slow phase, too wide in the fast one.

``CostMeter`` fits both from the seconds each round took, over exponentially decayed
observations so that it follows the host's phase within a few seconds of rounds:

* a verify over ``w`` tokens (the whole batch's) costs ``a + b * w`` seconds. An affine
  fit needs two widths to tell ``a`` from ``b``; a ridge term pulls ``b / a`` towards the
  configured curve's shape, so while every round verifies about the same width the prior
  shape holds and only the level follows the measurements;
* a draft forward costs ``f`` seconds: the decayed ratio of the seconds draft calls
  took to the forwards they ran, each prompt token the draft read first counted as the
  configured read cost's share of a forward. The read cost itself is not learned: reads
  are rare, their price per token falls with their length (on the 2-core EPYC a 50-token
  read cost 0.075 forwards a token, a 600-token one 0.045), and a read cost learned too
  high stops every read, and with them the data that would correct it (a benchmark whose
  first draft calls ran slow learned 0.27 and then drafted 0.01 forwards a round). Calls
  whose read outweighs their forwards are left out of the fit for the same reason.

Each observation is clipped at ``outlier`` times what the current fit predicts, so that a
stall of the host (a page fault storm, another process) moves the prices by a bounded
step and the decay washes it out.

Its answers are in the units the gates use: the verify curve relative to a one-token step
(``a + b``), the draft forward over that step. Decisions then depend on wall-clock time,
so reruns may build different trees; every tree is still verified by the target, so
outputs stay lossless. Plain Python arithmetic on a handful of floats per round: no
tensors, no host sync.
"""

from __future__ import annotations

import math

from sglang_graft.cost import VerifyCost, check_cost_ratio, check_read_cost


class _DecayedRidge:
    """``t ~ p * x + q * y`` by least squares over exponentially decayed observations, plus
    ``strength * (q - shape * p) ** 2``: a prior on the ratio ``q / p`` that decides what
    the observations cannot (all of them at one ``y / x``) and yields to them otherwise."""

    def __init__(self, decay: float, shape: float, strength: float) -> None:
        self.decay = decay
        self.shape = shape
        self.strength = strength
        self.weight = 0.0
        self._sums = [0.0] * 5  # x*x, x*y, y*y, x*t, y*t

    def observe(self, x: float, y: float, t: float) -> None:
        d = self.decay
        self.weight = d * self.weight + 1.0
        self._sums = [d * s + v for s, v in zip(self._sums, (x * x, x * y, y * y, x * t, y * t))]

    def solve(self) -> tuple[float, float] | None:
        """``(p, q)``, or None while the system is singular (nothing observed yet)."""
        xx, xy, yy, xt, yt = self._sums
        k, s = self.strength, self.shape
        m11, m12, m22 = xx + k * s * s, xy - k * s, yy + k
        det = m11 * m22 - m12 * m12
        if not det > 1e-12 * max(m11 * m22, 1e-300):
            return None
        return (xt * m22 - yt * m12) / det, (yt * m11 - xt * m12) / det


class CostMeter:
    """Learns the verify curve and the draft cost ratio from timed rounds.

    Args:
        verify_cost: the configured verify curve (its shape is the prior of the fit).
        draft_cost_ratio: the configured draft forward / one-token step (> 0).
        read_cost: the configured draft forwards per read token (>= 0; kept, not learned).
        num_nodes: the verify budget: the fitted curve is spelled out up to it.
        decay: weight of the past per observation (0.98: a verify's weight halves after
            34 rounds, a few seconds on a CPU).
        min_weight: decayed observations a fit needs before it replaces the configured
            values (verify and draft each).
        prior_strength: weight of the verify curve's shape prior, in observations one width
            step apart.
        outlier: an observation counts as at most this many times the current fit's
            prediction (> 1).
    """

    def __init__(
        self,
        verify_cost: VerifyCost,
        draft_cost_ratio: float,
        read_cost: float,
        num_nodes: int,
        decay: float = 0.98,
        min_weight: float = 4.0,
        prior_strength: float = 4.0,
        outlier: float = 3.0,
    ) -> None:
        check_cost_ratio(draft_cost_ratio)
        check_read_cost(read_cost)
        if num_nodes < 2:
            raise ValueError(f"num_nodes (verify budget n) must be >= 2, got {num_nodes}")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        if not min_weight > 0 or not prior_strength > 0:
            raise ValueError(f"min_weight and prior_strength must be > 0, got {min_weight} and {prior_strength}")
        if not outlier > 1.0:
            raise ValueError(f"outlier must be > 1 (a multiple of the predicted time), got {outlier}")
        self.num_nodes = num_nodes
        self.min_weight = min_weight
        self.decay = decay
        self.outlier = outlier
        self.configured = (verify_cost, float(draft_cost_ratio), float(read_cost))
        # The configured curve's shape as b / a of ``a + b * w``, through its 1- and n-token
        # points (a curve adding a whole step per token, which no host has shown, gets 1).
        slope = max(verify_cost(num_nodes) - 1.0, 0.0) / (num_nodes - 1)
        self._verify = _DecayedRidge(decay, slope / (1.0 - slope) if slope < 1.0 else 1.0, prior_strength)
        # Draft calls, decayed: their seconds, their forward units (forwards + read_cost * read), their count.
        self._draft_seconds = self._draft_units = self._draft_weight = 0.0

    def observe_verify(self, tokens: int, seconds: float) -> None:
        """A verify forward over ``tokens`` tokens (the batch's total) took ``seconds``."""
        if tokens >= 1 and math.isfinite(seconds) and seconds > 0:
            fit = self._verify_fit()
            if fit is not None:
                seconds = min(seconds, self.outlier * (fit[0] + fit[1] * tokens))
            self._verify.observe(1.0, float(tokens), seconds)

    def observe_draft(self, forwards: int, read_tokens: int, seconds: float) -> None:
        """A draft call of ``forwards`` forwards, after reading ``read_tokens``, took ``seconds``."""
        read = self.configured[2] * max(read_tokens, 0)
        if forwards >= 1 and read <= forwards and math.isfinite(seconds) and seconds > 0:
            units = forwards + read
            forward = self._forward_seconds()
            if forward is not None:
                seconds = min(seconds, self.outlier * forward * units)
            self._draft_seconds = self.decay * self._draft_seconds + seconds
            self._draft_units = self.decay * self._draft_units + units
            self._draft_weight = self.decay * self._draft_weight + 1.0

    def step_seconds(self) -> float | None:
        """The fitted one-token target step, in seconds (None before enough verifies)."""
        fit = self._verify_fit()
        return None if fit is None else fit[0] + fit[1]

    def verify_cost(self) -> VerifyCost:
        """The verify curve in one-token steps: the fit, or the configured curve until then."""
        fit = self._verify_fit()
        if fit is None:
            return self.configured[0]
        a, b = fit
        return VerifyCost(((1, a + b), (self.num_nodes, a + b * self.num_nodes)))

    def draft_cost_ratio(self) -> float:
        """One draft forward over one target step: the fits', or the configured ratio."""
        step, forward = self.step_seconds(), self._forward_seconds()
        if step is None or forward is None:
            return self.configured[1]
        return forward / step

    def flags(self) -> str:
        """What the meter has learned, as the reference engine's flags that would price
        rounds the same way (milliseconds, like ``scripts/bench_forward_cost.py`` prints)."""
        fit = self._verify_fit()
        if fit is None:
            curve = ",".join(f"{t}:{c:g}" for t, c in self.configured[0].points)
        else:
            a, b = fit
            curve = f"1:{(a + b) * 1e3:.1f},{self.num_nodes}:{(a + b * self.num_nodes) * 1e3:.1f}"
        return f"--verify-costs {curve} --draft-cost-ratio {self.draft_cost_ratio():.3f}"

    def _verify_fit(self) -> tuple[float, float] | None:
        """``(a, b)`` with ``a > 0``, ``b >= 0`` once the verifies weigh enough."""
        fit = self._verify.solve() if self._verify.weight >= self.min_weight else None
        if fit is None:
            return None
        a, b = fit
        b = max(b, 0.0)
        # A negative intercept (a steep fit from noisy widths) would price one token at
        # nothing; a forward costs at least what its weights take to stream once.
        return (a, b) if a > 0 else None

    def _forward_seconds(self) -> float | None:
        """Seconds per draft forward once the draft calls weigh enough."""
        return self._draft_seconds / self._draft_units if self._draft_weight >= self.min_weight else None
