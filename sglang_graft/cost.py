"""Cost-aware drafting: draft (and draft deeper) only while it pays for itself.

A verify round costs one target forward plus one draft forward per drafted level; in units
of the target forward it costs ``1 + d * r`` after ``d`` levels, where ``r`` is the draft
forward's cost relative to the target's (``draft_cost_ratio``). The round yields
``T = 1 + sum_j q_j`` tokens in expectation, ``q_j`` being the calibrated probability that
the best depth-``j`` path is accepted (plus the bonus token).

What decoding should maximise is the long-run rate ``R`` (tokens per unit of time over all
rounds), not the rate of the round at hand. Decoding is a renewal-reward process: a round
that spends ``c`` units to yield ``T`` tokens raises the long-run rate exactly when
``T - R * c`` grows, so a choice that costs ``dc`` more must yield more than ``R * dc``
extra tokens. A round that looks poor on its own (retrieval has nothing for a fresh token
at the start of a copied span) is therefore not worth a draft forward when the request has
been copying at four tokens per unit and the draft would add one or two: the next round
copies them anyway. ``RoundRate`` keeps ``R`` (a running ratio of tokens to cost over all
rounds). The two decisions:

* ``DraftOrRetrieve``: before any draft forward, whether the draft adds more tokens over
  retrieval alone than ``R`` times the cost of its forwards.
* ``DepthBudget``: after ``d`` levels, another ``h`` levels add about ``G_h = q_d * (rho_d +
  rho_d * rho_{d+1} + ...)`` tokens, where ``rho_j`` is how much of the path probability
  typically survives one more level (learned online from the draft's own calibrated
  scores), for ``h * r`` more units: a request drafts deeper while ``G_h > h * r`` for some
  look-ahead ``h``, i.e. while a level adds more than plain decoding would emit in the time
  its forward takes. ``G_h`` counts only the best path, not the side branches a level adds
  nor the longer paths it lets retrieval's nodes hang under, so it understates a level's
  worth: on Spec-Bench (n = 16, 6 prompts, bf16 CPU pair) the stricter bars drafted less
  and yielded fewer tokens per verify-equivalent, 5% fewer with the round's own rate
  (``T / c``), 6% with ``R``.
  Deep drafting continues on predictable text (code, arithmetic), where the draft's
  confidence stays high, and stops after one or two levels on open text.

ECHO's fixed thresholds ask "is the draft sure?"; these ask "is the draft sure enough to be
worth its forward?", with the draft's price in the question. The cost ratio is a fixed
setting, not a wall-clock measurement, so every process (tensor-parallel ranks included)
and every rerun with the same seed builds the same trees (the reference engine's opt-in
``online_costs`` trades that for costs that follow a drifting host: ``cost_meter``).

Both decisions read a few numbers back to the host per draft level (they steer a Python
draft loop); the reference engine uses them, the SGLang worker, whose draft loop runs in
CUDA graphs, does not.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import torch

#: How much of the path probability one more level keeps, before anything is observed.
_PRIOR_SURVIVAL = 0.8

#: Draft forwards one unread token adds to a draft forward (``DraftOrRetrieve``'s
#: ``read_cost``), measured for a 0.5B bf16 draft on 2 CPU cores: 84 ms for 1 token, 1917
#: ms for 1024. An int8 draft's one-token forward is twice as cheap but its prefill is not,
#: so its read cost is three times this (``engine.config.INT8_DRAFT_READ_COST``).
DEFAULT_READ_COST = 0.015


def check_cost_ratio(ratio: float | None) -> None:
    """Raise ``ValueError`` unless ``ratio`` (draft forward / target verify time) is None or > 0."""
    if ratio is not None and not ratio > 0:
        raise ValueError(f"draft_cost_ratio (draft forward / target verify time) must be > 0, got {ratio}")


def check_read_cost(read_cost: float) -> None:
    """Raise ``ValueError`` unless ``read_cost`` (draft forwards per unread token) is finite and >= 0."""
    if not (math.isfinite(read_cost) and read_cost >= 0.0):
        raise ValueError(
            "draft read cost (--draft-read-cost, read_cost: the draft forwards one unread prompt token adds) "
            f"must be a finite number >= 0, got {read_cost}"
        )


class RoundRate:
    """The long-run rate ``R``: tokens per unit of time (one target verify) over past rounds.

    A running ratio of tokens to cost (the renewal-reward estimate of a rate, which a mean
    of per-round rates is not), starting from one round of plain decoding: 1 token for 1
    unit. ``DraftOrRetrieve`` compares the draft's extra tokens with ``R`` times their
    extra cost.

    Args:
        draft_cost_ratio: draft forward time / target verify forward time, > 0.
        ema: weight of the past in the running sums.
    """

    def __init__(self, draft_cost_ratio: float, ema: float = 0.9) -> None:
        check_cost_ratio(draft_cost_ratio)
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.ratio = float(draft_cost_ratio)
        self.ema = ema
        self.tokens = 1.0
        self.cost = 1.0

    @property
    def value(self) -> float:
        return self.tokens / self.cost

    def observe(self, tokens_per_request: float, forwards: int, verify_cost: float = 1.0) -> None:
        """Record a verify round: mean tokens per request (bonus included), draft forwards,
        and what its verify cost (1: a verify forward at the full budget ``n``, or the
        ``VerifyCost`` of the tree actually verified)."""
        e = self.ema
        self.tokens = e * self.tokens + (1.0 - e) * tokens_per_request
        self.cost = e * self.cost + (1.0 - e) * (verify_cost + forwards * self.ratio)


class DepthBudget:
    """Per-round draft-depth decisions from the draft's calibrated path scores.

    Call ``continues(depth, q)`` after each drafted level, in order (``depth`` 1 starts a
    round). ``q`` is ``[bs]``: the calibrated P(accept) of each request's best path at that
    depth.

    Args:
        draft_cost_ratio: draft forward time / target verify forward time, > 0.
        max_depth: the deepest level the drafter may reach (bounds the look-ahead).
        ema: weight of the past in the running survival ratios ``rho``.
    """

    def __init__(self, draft_cost_ratio: float, max_depth: int, ema: float = 0.95) -> None:
        check_cost_ratio(draft_cost_ratio)
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.ratio = float(draft_cost_ratio)
        self.max_depth = max_depth
        self.ema = ema
        self.survival = torch.full((max_depth + 1,), _PRIOR_SURVIVAL, dtype=torch.float64)
        self._last: tuple[int, torch.Tensor] | None = None  # this round's latest (depth, q)

    def continues(self, depth: int, q: torch.Tensor) -> torch.Tensor:
        """``[bs]`` bool: is drafting level ``depth + 1`` expected to pay for its forward."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        q = q.detach().double().cpu().clamp(0.0, 1.0)
        if self._last is not None and self._last[0] == depth - 1:
            self._learn_survival(depth - 1, self._last[1], q)
        self._last = (depth, q)
        if depth >= self.max_depth:
            return torch.zeros_like(q, dtype=torch.bool)
        horizon = self.max_depth - depth
        rho = self.survival[depth : depth + horizon]
        gains = q.unsqueeze(1) * torch.cumsum(torch.cumprod(rho, dim=0), dim=0).unsqueeze(0)  # [bs, h]
        extra_cost = self.ratio * torch.arange(1, horizon + 1, dtype=torch.float64)
        return (gains > extra_cost).any(dim=1)

    def _learn_survival(self, depth: int, q_prev: torch.Tensor, q_next: torch.Tensor) -> None:
        """Update ``rho_depth`` from the requests that drafted past ``depth`` this round."""
        live = q_prev > 0
        if q_prev.shape != q_next.shape or not bool(live.any()):
            return
        ratio = (q_next[live] / q_prev[live]).clamp(max=1.0).mean()
        self.survival[depth] = self.ema * self.survival[depth] + (1.0 - self.ema) * ratio


class DraftOrRetrieve:
    """Per round, before any draft forward: is drafting worth its price, or does retrieval
    alone fill the tree well enough?

    Retrieval costs no model forward, and its nodes carry calibrated P(path accepted)
    scores, so the sum of the best ``n - 1`` retrieval scores predicts how many tokens
    beyond the bonus a retrieval-only round yields (the expected size of the accepted path
    is the sum of its nodes' acceptance probabilities), at the cost of one verify. Those
    per-node estimates are learned in rounds where drafts sit beside them, so the sum is
    itself checked against what retrieval-only rounds really yield: the prediction is
    scaled by ``realised / predicted`` over past skipped rounds. A drafted round yields
    what drafted rounds have been yielding (an exponentially weighted mean of tokens per
    round that weighs the first rounds like the rest: an average seeded with its first
    sample would hold an unlucky first round, say the bonus token alone, at ten rounds'
    weight, and drafting stayed off for most of a 128-token answer the draft could follow) for
    ``forwards * draft_cost_ratio`` more units, plus whatever its verify costs over a
    retrieval-only round's (running means of both; nothing when every verify costs the
    same, which it does unless ``VerifyCost`` trims trees). A request drafts when those extra tokens
    beat the long-run rate ``R`` times the extra cost (see the module docstring): copied
    spans (code, quotes, summaries of the prompt) run on retrieval alone, and so do the
    rounds between them where retrieval is dry for a moment, while open text drafts.
    Until ``warmup`` drafted rounds are observed every request drafts (one round is a
    poor sample: the first token of an answer is often one the draft misses), and after
    ``explore_every`` retrieval-only rounds in a row the batch drafts once, so the drafted
    yield is measured again: one bad stretch (a warm-up, a request the draft could not
    follow) cannot lock drafting out for good.

    The drafter reads the tokens it skipped at the start of its next round. A few tokens
    cost about as much as one, but a drafter that has not read the prompt yet (the drafted
    yield is learned across requests, so a new request may start on retrieval alone) must
    prefill all of it first, which on a long prompt costs many verify steps: a request's
    drafted round is charged ``read_cost * draft_cost_ratio`` verify units per unread
    token, spread over ``explore_every`` rounds (the prefill pays off over the rounds after
    it, which the drafted yield does not see), so a long prompt is not prefilled merely to
    explore. Exploration rounds draft every request whose prefill costs under one draft
    forward (its drafter is warm); a cold one drafts only when the yields say so.

    A cold drafter (one that has read nothing of its request yet) drafts at once when its
    prompt is short: when the read costs at most ``explore_every`` draft forwards, i.e. at
    most one forward a round over the horizon the charge spreads it over, what an
    exploration round pays. The read is then paid once and every later round of the
    request weighs draft against retrieval with a warm drafter, whereas a short request
    that waited for the gate could run out on retrieval alone. Long prompts (summaries,
    RAG contexts) keep the charge and retrieve first. On 48 Spec-Bench questions (2-core
    Zen 5 EPYC, priced in model time) translation gained 5% and QA 11%, mt_bench lost 1%,
    overall +0.4%.

    Args:
        draft_cost_ratio: draft forward time / target verify forward time, > 0.
        ema: weight of the past in the running means.
        explore_every: retrieval-only rounds in a row after which the batch drafts (>= 1).
        warmup: drafted rounds observed before the yields decide (>= 1).
        read_cost: draft forwards one unread token adds to a draft forward (>= 0; a
            prefill of ``q`` tokens costs about ``1 + q * read_cost`` forwards; see
            ``DEFAULT_READ_COST``; ``scripts/bench_forward_cost.py`` measures it).
    """

    def __init__(
        self,
        draft_cost_ratio: float,
        ema: float = 0.9,
        explore_every: int = 8,
        read_cost: float = DEFAULT_READ_COST,
        warmup: int = 3,
    ) -> None:
        check_cost_ratio(draft_cost_ratio)
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        if explore_every < 1:
            raise ValueError(f"explore_every must be >= 1 round, got {explore_every}")
        check_read_cost(read_cost)
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 drafted round, got {warmup}")
        self.ratio = float(draft_cost_ratio)
        self.ema = ema
        self.explore_every = explore_every
        self.read_cost = float(read_cost)
        self.warmup = warmup
        self.drafted_rounds = 0
        self.rate = RoundRate(draft_cost_ratio, ema)  # R over every observed round
        self.skipped_in_a_row = 0
        # Drafted rounds: exponentially weighted sums of tokens (bonus included) and draft
        # forwards, and of the weights, so their means weigh the first rounds like any other.
        self._drafted_sums = [0.0, 0.0, 0.0]  # tokens, forwards, weight
        # Verify cost of drafted and of retrieval-only rounds (1 and 1 unless the verify
        # width varies: a drafted tree holds more nodes worth verifying, see VerifyCost).
        self.drafted_verify = 1.0
        self.skipped_verify = 1.0
        # Skipped rounds: predicted and realised tokens beyond the bonus, running sums
        # that start as one prior round where the prediction came true.
        self.skipped_predicted = 1.0
        self.skipped_realised = 1.0
        self._prediction: float | None = None  # this round's batch-mean prediction

    @property
    def drafted_tokens(self) -> float | None:
        """Mean tokens per drafted round, bonus included (None before the first)."""
        tokens, _, weight = self._drafted_sums
        return tokens / weight if weight else None

    @property
    def drafted_forwards(self) -> float | None:
        """Mean draft forwards per drafted round (None before the first)."""
        _, forwards, weight = self._drafted_sums
        return forwards / weight if weight else None

    @property
    def realism(self) -> float:
        """Realised / predicted retrieval yield of past skipped rounds."""
        return self.skipped_realised / self.skipped_predicted

    def wants_draft(
        self,
        retrieved_scores: torch.Tensor,
        valid: torch.Tensor,
        slots: int,
        unread: torch.Tensor | None = None,
        cold: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[bs]`` bool from the retrieval proposal's ``[bs, m]`` calibrated scores, the
        ``[bs]`` tokens each request's drafter has yet to read (None: a few, uncharged) and
        which drafters have read nothing yet (``[bs]`` bool; None: none)."""
        bs = retrieved_scores.shape[0]
        device = retrieved_scores.device
        self._prediction = None
        if self.drafted_tokens is None or self.drafted_forwards is None or self.drafted_rounds < self.warmup:
            return torch.ones(bs, dtype=torch.bool, device=device)
        charge = torch.zeros(bs, dtype=torch.float64, device=device)
        if unread is not None:
            charge = unread.to(device=device, dtype=torch.float64) * (self.read_cost * self.ratio / self.explore_every)
        scores = torch.where(valid, retrieved_scores.float(), 0.0)
        predicted = scores.topk(min(slots, scores.shape[1]), dim=1).values.sum(dim=1)
        gain = self.drafted_tokens - (1.0 + self.realism * predicted)
        extra_verify = max(self.drafted_verify - self.skipped_verify, 0.0)
        draft = gain > self.rate.value * (self.drafted_forwards * self.ratio + extra_verify + charge)
        self._prediction = float(predicted.mean())
        if self.skipped_in_a_row >= self.explore_every:
            draft |= charge * self.explore_every < self.ratio
        if cold is not None and unread is not None:
            short = unread.to(device=device, dtype=torch.float64) * self.read_cost <= self.explore_every
            draft |= cold.to(device) & short
        return draft

    def observe(self, tokens_per_request: float, forwards: int, verify_cost: float = 1.0) -> None:
        """Record a verify round: mean tokens emitted per request (bonus included), the
        draft forwards it took (0: it ran on retrieval alone) and its verify's cost."""
        e = self.ema
        self.rate.observe(tokens_per_request, forwards, verify_cost)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if forwards == 0 else 0
        if forwards == 0:
            self.skipped_verify = e * self.skipped_verify + (1.0 - e) * verify_cost
            if self._prediction is not None:
                self.skipped_predicted = e * self.skipped_predicted + (1.0 - e) * self._prediction
                self.skipped_realised = e * self.skipped_realised + (1.0 - e) * (tokens_per_request - 1.0)
        else:
            self.drafted_verify = e * self.drafted_verify + (1.0 - e) * verify_cost
            self.drafted_rounds += 1
            tokens, fwd, weight = self._drafted_sums
            self._drafted_sums = [e * tokens + tokens_per_request, e * fwd + forwards, e * weight + 1.0]
        self._prediction = None


class VerifyCost:
    """What a verify forward over ``w`` tokens costs, and the tree width that pays best.

    On a GPU a verify over 16 or 64 tokens costs what a one-token decode step does, so the
    verify budget ``n`` is always filled. On a CPU it need not: on a 2-core AMD EPYC a bf16
    1.5B target took 1.15 one-token steps for 8 tokens and 1.33 for 16, while two Intel
    hosts ran 16 tokens for the price of one. There, a slot is worth filling only with a
    node likely enough to be accepted: the expected accepted path of a tree is the sum of
    its nodes' calibrated P(path accepted), so keeping the ``w - 1`` best nodes yields
    ``T(w) = 1 + sum of the w - 1 best scores`` tokens for ``cost(w)``, and (see the module
    docstring) the round should maximise ``T(w) - R * cost(w)`` with ``R`` the long-run
    rate. The best ``w - 1`` nodes by (score desc, depth asc) form a tree, because a parent
    scores at least its child (``graft.trim`` keeps them).

    A batch shares one width (its rows are padded alike), and a batched forward's cost is
    read at its total token count, relative to the batch's own one-token step.

    Args:
        points: ``(tokens, cost)`` pairs measured on the host (``scripts/bench_forward_cost.py``
            prints them), tokens strictly increasing from 1, costs > 0 in any unit (they
            are divided by the cost of one token); linear between points and beyond the last
            two.
    """

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        if isinstance(points, str):
            raise ValueError(
                f"verify costs must be (tokens, cost) pairs, got the string {points!r}; "
                "parse the text form with VerifyCost.parse(text).points"
            )
        pts = [(int(t), float(c)) for t, c in points]
        if len(pts) < 2 or pts[0][0] != 1:
            raise ValueError(
                f"verify costs need at least two (tokens, cost) points starting at 1 token, got {pts}; "
                "e.g. ((1, 1.0), (8, 1.15), (16, 1.33))"
            )
        for (t0, _), (t1, _) in zip(pts, pts[1:]):
            if t1 <= t0:
                raise ValueError(f"verify cost token counts must increase strictly, got {t0} then {t1}")
        for t, c in pts:
            if not (math.isfinite(c) and c > 0):
                raise ValueError(f"verify cost at {t} tokens must be a finite number > 0, got {c}")
        # A forward over more tokens never costs less: a measured dip is timing noise.
        costs = list(itertools.accumulate((c / pts[0][1] for _, c in pts), max))
        self.points = tuple(pts)
        self.tokens = [t for t, _ in pts]
        self.costs = costs

    @staticmethod
    def parse(text: str) -> "VerifyCost":
        """From ``"1:1,8:1.15,16:1.33"`` (tokens:cost pairs), the form the CLI takes."""
        try:
            pairs = [item.split(":") for item in text.split(",") if item.strip()]
            points = [(int(t), float(c)) for t, c in pairs]
        except ValueError:
            raise ValueError(f"verify costs must look like '1:1,8:1.15,16:1.33' (tokens:cost pairs), got {text!r}")
        return VerifyCost(points)

    def __call__(self, tokens: int) -> float:
        """Cost of a forward over ``tokens`` tokens, in one-token forwards."""
        i = min(max(bisect.bisect_left(self.tokens, tokens), 1), len(self.tokens) - 1)
        t0, t1, c0, c1 = self.tokens[i - 1], self.tokens[i], self.costs[i - 1], self.costs[i]
        return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)

    def batch_cost(self, batch_size: int, width: int) -> float:
        """A batch's verify over ``width`` tokens per request, in that batch's one-token steps."""
        return self(batch_size * width) / self(batch_size)

    def best_width(self, node_scores: torch.Tensor, rate: float) -> int:
        """The width ``w`` (root included, ``2 <= w <= n``) that maximises
        ``T(w) - rate * cost(w)`` per request, from a ``[bs, n]`` tree's node scores
        (column 0 the root; filler nodes score 0); the smallest such ``w`` on ties. (A
        two-token verify costs what a one-token step does on every host measured, so the
        root always keeps one node.)"""
        bs, n = node_scores.shape
        if n <= 2:
            return n
        best = node_scores[:, 1:].double().sort(dim=1, descending=True).values.cumsum(dim=1).sum(dim=0) / bs
        gains = [tokens - rate * self.batch_cost(bs, w) for w, tokens in enumerate(best.tolist(), start=2)]
        return 2 + max(range(len(gains)), key=lambda i: (gains[i], -i))


class RoundCost:
    """What a verify round costs in one-token target steps, under the same model the gates
    price their choices with: the verify curve at the round's width, plus
    ``draft_cost_ratio`` per draft forward and per ``1 / read_cost`` tokens the drafter
    read before drafting (a prompt, or the tokens of rounds it skipped).

    Plain decoding costs exactly one per token, so tokens over summed costs is a speedup
    over it in modelled decode time (prefill excluded: it is the same for every method).
    Unlike tokens/s it does not move with the host's speed, and a rerun reproduces it to
    the digit: the figure to compare policy changes by on a host whose speed drifts.

    Args:
        verify: the host's verify curve, or None for a flat one (every round costs one
            step, as on a GPU).
        draft_cost_ratio: draft forward / one-token target step (>= 0; 0 without a draft).
        read_cost: draft forwards one read token adds (>= 0).
    """

    def __init__(self, verify: VerifyCost | None, draft_cost_ratio: float, read_cost: float) -> None:
        if not (math.isfinite(draft_cost_ratio) and draft_cost_ratio >= 0):
            raise ValueError(f"draft_cost_ratio must be a finite number >= 0, got {draft_cost_ratio}")
        check_read_cost(read_cost)
        self.verify = verify
        self.draft_cost_ratio = float(draft_cost_ratio)
        self.read_cost = float(read_cost)

    def __call__(self, batch_size: int, width: int, draft_forwards: int = 0, read_tokens: int = 0) -> float:
        """One round of a ``batch_size`` batch verifying ``width`` tokens per request."""
        verify = 1.0 if self.verify is None else self.verify.batch_cost(batch_size, width)
        return verify + self.draft_cost_ratio * (draft_forwards + self.read_cost * read_tokens)
