"""What a generation returns: tokens plus the counters every report is built from.

The counters are kept raw (sums), never as averages, so per-category and overall figures
are always ratios of sums: tau = tokens / verify rounds, tokens/s = tokens / seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_graft.candidates import SOURCE_NAMES, Source

#: Sources a proposal can come from (the root is verified already, not proposed).
PROPOSAL_SOURCES: tuple[str, ...] = tuple(SOURCE_NAMES[s] for s in Source if s != Source.ROOT)


@dataclass
class RequestOutput:
    """One request's generation.

    Attributes:
        token_ids: generated ids (a stop token, if hit, is the last one).
        finish_reason: ``"stop"`` (a stop token) or ``"length"`` (``max_new_tokens``).
        rounds: target verify forwards (tau = len(token_ids) / rounds).
        draft_forwards: draft model forwards during those rounds.
        verify_tokens: tree nodes verified, summed over rounds.
        accepted: accepted proposals per source name (bonus tokens excluded).
        margins: the target's top-1 minus top-2 logit at each generated position, as
            computed in this run (how close that choice was to a tie).
        model_cost: the rounds' modelled time in one-token target steps
            (``sglang_graft.cost.RoundCost``; prefill excluded); 0 where not modelled
            (transformers' baselines).
        prefill_s: wall seconds the target spent reading the prompt (a batch's rows share
            one prefill and each carries its time). transformers' baselines have no
            separate prefill: theirs is the first target forward, over the prompt and the
            first candidates.
    """

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    rounds: int = 0
    draft_forwards: int = 0
    verify_tokens: int = 0
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROPOSAL_SOURCES, 0))
    margins: list[float] = field(default_factory=list)
    model_cost: float = 0.0
    prefill_s: float = 0.0

    @property
    def tau(self) -> float:
        return len(self.token_ids) / self.rounds if self.rounds else 0.0


@dataclass
class BatchOutput:
    """A batch's requests (in prompt order) and the wall time of the whole call."""

    requests: list[RequestOutput]
    elapsed_s: float

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class Totals:
    """Sums over any set of requests, and the figures derived from them."""

    tokens: int = 0
    rounds: int = 0
    draft_forwards: int = 0
    verify_tokens: int = 0
    seconds: float = 0.0
    prefill_s: float = 0.0
    model_cost: float = 0.0
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROPOSAL_SOURCES, 0))

    def add(self, r: RequestOutput, seconds: float) -> None:
        self.tokens += len(r.token_ids)
        self.rounds += r.rounds
        self.draft_forwards += r.draft_forwards
        self.verify_tokens += r.verify_tokens
        self.seconds += seconds
        self.prefill_s += r.prefill_s
        self.model_cost += r.model_cost
        for k, v in r.accepted.items():
            self.accepted[k] += v

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the time after the target's prefill: what speculation
        changes (a draft model's prefill counts, it is part of speculating). On long prompts
        the target's prefill, alike for every method, is much of ``seconds`` and pulls every
        ``tokens_per_s`` ratio towards 1."""
        decode = self.seconds - self.prefill_s
        return self.tokens / decode if decode > 0 else 0.0

    @property
    def modelled_speedup(self) -> float | None:
        """Tokens per modelled one-token target step (``RequestOutput.model_cost``): the
        speedup over plain decoding in decode time under the cost model; None unmodelled."""
        return self.tokens / self.model_cost if self.model_cost > 0 else None

    def accepted_share(self) -> dict[str, float]:
        """Share of accepted proposals per source (0 everywhere when none was accepted)."""
        total = sum(self.accepted.values())
        return {k: (v / total if total else 0.0) for k, v in self.accepted.items()}

    def summary(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "rounds": self.rounds,
            "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_s, 4),
            "tau": self.tau,
            "draft_forwards_per_round": self.draft_forwards / self.rounds if self.rounds else 0.0,
            "verify_tokens_per_round": self.verify_tokens / self.rounds if self.rounds else 0.0,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "modelled_speedup": self.modelled_speedup,
            "accepted_share_by_source": self.accepted_share(),
        }
