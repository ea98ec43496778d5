"""What a target forward over a few new tokens costs on this host, for ``--verify-costs``.

A verify over ``n`` tokens costs what a one-token step does on a GPU and on some CPUs, and
up to 1.3x more for 16 tokens on others (docs/BENCHMARKS.md, "Reference engine on real
models"); the cost-aware verify width (``sglang_graft.cost.VerifyCost``) needs that curve.
It is timed on the loaded model, round-robin over the token counts so that a host whose
speed drifts slows them all alike; ``scripts/bench_forward_cost.py`` prints the same table
for both models.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from sglang_graft.engine.draft_head import decoder_logits
from sglang_graft.engine.kv import GrowingCache

logger = logging.getLogger(__name__)

#: Token counts timed by ``measure_verify_costs`` (those up to the verify budget, plus it).
_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


class ForwardTimer:
    """Times one model's forwards over a few new tokens after the same ``context`` cached
    (random) tokens; with ``head`` (a ``DraftHead``) the logits come from it instead of the
    model's own LM head."""

    def __init__(
        self,
        model: torch.nn.Module,
        context: int,
        vocab: int,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.vocab = vocab
        self.head = head
        self.device = next(model.parameters()).device
        self.gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            prompt = torch.randint(0, vocab, (1, context), generator=self.gen).to(self.device)
            # The engine's cache kind, so the copies a forward makes (none: it appends in
            # place) are the ones decoding pays.
            self.cache = GrowingCache()
            model(prompt, past_key_values=self.cache, use_cache=True)

    @torch.inference_mode()
    def seconds(self, q: int) -> float:
        """One forward over ``q`` new tokens; the cache is cropped back afterwards."""
        x = torch.randint(0, self.vocab, (1, q), generator=self.gen).to(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        if self.head is None:
            self.model(x, past_key_values=self.cache, use_cache=True, logits_to_keep=q)
        else:
            decoder_logits(self.model, self.head, input_ids=x, past_key_values=self.cache, use_cache=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.cache.crop(-q)
        return elapsed


def interleaved_ms(timers: dict[str, ForwardTimer], counts: list[int], reps: int) -> dict[str, dict[int, float]]:
    """Median milliseconds per timer and count, timed round-robin over timers and counts
    (one forward of each per rep, after one warm-up), so that a host whose speed drifts
    between minutes slows every model and count alike."""
    times: dict[str, dict[int, list[float]]] = {name: {q: [] for q in counts} for name in timers}
    for _ in range(reps + 1):
        for name, timer in timers.items():
            for q in counts:
                times[name][q].append(timer.seconds(q))
    return {name: {q: statistics.median(t[1:]) * 1e3 for q, t in per.items()} for name, per in times.items()}


def forward_ms(
    model: torch.nn.Module,
    context: int,
    counts: list[int],
    reps: int,
    vocab: int,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[int, float]:
    """Median milliseconds of one model's forward over each of ``counts`` new tokens after
    ``context`` cached tokens (``interleaved_ms`` of a single ``ForwardTimer``)."""
    return interleaved_ms({"model": ForwardTimer(model, context, vocab, head)}, counts, reps)["model"]


@torch.inference_mode()
def prefill_ms(
    model: torch.nn.Module,
    tokens: int,
    reps: int,
    vocab: int,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Median milliseconds of a forward over ``tokens`` fresh (random) tokens, no cache: a
    prefill, as a drafter's first draft on a prompt runs it (after one warm-up)."""
    if tokens < 1 or reps < 1:
        raise ValueError(f"prefill tokens and reps must be >= 1, got tokens={tokens}, reps={reps}")
    gen = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    times = []
    for _ in range(reps + 1):
        x = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)
        start = time.perf_counter()
        if head is None:
            model(x, logits_to_keep=1)
        else:
            decoder_logits(model, head, 1, input_ids=x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


#: Decoder blocks timed whole by ``breakdown_ms``, by the last part of their module name;
#: the linear layers inside them (any child with a 2-D weight) are timed one by one.
_BLOCKS = {"self_attn": "attention", "mlp": "mlp other"}


def _parts(model: torch.nn.Module) -> dict[torch.nn.Module, tuple[str, str | None]]:
    """Module -> (part, enclosing block part or None) for ``breakdown_ms``: decoder blocks,
    the linear layers inside them (by their own name, e.g. ``gate_proj``), the norms outside
    them and the LM head."""
    head = model.get_output_embeddings()
    parts: dict[torch.nn.Module, tuple[str, str | None]] = {}
    for name, module in model.named_modules():
        path = name.split(".")
        block = next((_BLOCKS[p] for p in path[:-1] if p in _BLOCKS), None)
        if path[-1] in _BLOCKS:
            parts[module] = (_BLOCKS[path[-1]], None)
        elif block is not None and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
            parts[module] = (path[-1], block)
        elif module is head:
            parts[module] = ("lm head", None)
        elif block is None and "norm" in path[-1].lower():
            parts[module] = ("norms", None)
    return parts


def breakdown_ms(timer: ForwardTimer, counts: list[int], reps: int) -> dict[int, dict[str, float]]:
    """Where a forward's time goes: for each of ``counts`` new tokens, median milliseconds
    (over ``reps`` forwards after one warm-up, counts round-robin) of each linear layer kind
    summed over the layers (``q_proj``, ..., ``down_proj``), ``attention`` (the attention
    blocks less their projections), ``mlp other`` (the MLP blocks less theirs: activation
    and product), ``norms`` (outside the blocks), ``lm head``, ``other`` (the rest of the
    forward: embedding, rotary tables, residual adds, cache update, Python) and ``total``.

    Module hooks time each part by the wall clock, so kernels outside PyTorch's operators
    are counted where they run (PyTorch's profiler does not see them)."""
    parts = _parts(timer.model)
    seconds: dict[torch.nn.Module, float] = {}
    started: dict[torch.nn.Module, float] = {}

    def pre(module: torch.nn.Module, args: object) -> None:
        started[module] = time.perf_counter()

    def post(module: torch.nn.Module, args: object, output: object) -> None:
        seconds[module] = seconds.get(module, 0.0) + time.perf_counter() - started[module]

    handles = [h for m in parts for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    samples: dict[int, dict[str, list[float]]] = {q: {} for q in counts}
    try:
        for rep in range(reps + 1):
            for q in counts:
                seconds.clear()
                total = timer.seconds(q)
                if rep == 0:
                    continue
                split: dict[str, float] = {"total": total, "other": total}
                for module, spent in seconds.items():
                    part, block = parts[module]
                    # A block's time is charged less its linear layers; the rest's, less the blocks.
                    for key, sign in ((part, 1.0), (block or "other", -1.0)):
                        split[key] = split.get(key, 0.0) + sign * spent
                for part, spent in split.items():
                    samples[q].setdefault(part, []).append(spent)
    finally:
        for handle in handles:
            handle.remove()
    return {q: {part: statistics.median(t) * 1e3 for part, t in per.items()} for q, per in samples.items()}


def read_cost(prefill: float, one_token: float, tokens: int) -> float:
    """Draft forwards one more unread token adds (``--draft-read-cost``), from the time of a
    prefill over ``tokens`` tokens and of a one-token forward (any one unit)."""
    return max(prefill / one_token - 1.0, 0.0) / tokens


def measure_verify_costs(model: torch.nn.Module, num_nodes: int, context: int = 256, reps: int = 3) -> tuple[tuple[int, float], ...]:
    """``(tokens, ms)`` of the target's forwards up to ``num_nodes`` tokens, as
    ``EngineConfig.verify_costs`` takes them (about ``reps + 1`` decode steps per count)."""
    if num_nodes < 2:
        raise ValueError(f"num_nodes (verify budget n) must be >= 2, got {num_nodes}")
    counts = sorted({q for q in _COUNTS if q <= num_nodes} | {num_nodes})
    vocab = int(model.config.get_text_config().vocab_size)
    ms = forward_ms(model, context, counts, reps, vocab)
    logger.info(
        "verify costs measured on this host (ms per target forward over T tokens): --verify-costs %s",
        verify_costs_flag(ms),
    )
    return tuple((q, round(ms[q], 1)) for q in counts)


def verify_costs_flag(target_ms: dict[int, float]) -> str:
    """Measured milliseconds per token count as ``--verify-costs`` takes them."""
    return ",".join(f"{q}:{target_ms[q]:.1f}" for q in sorted(target_ms))
