"""What a user would pick today: transformers' own assisted generation and prompt lookup.

Both run through ``model.generate`` with greedy settings. Their rounds are counted by a
forward hook on each model, so their tau (tokens per target forward) and draft forwards
per round are measured the same way as the engine's, not estimated.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from sglang_graft.engine.outputs import RequestOutput

BASELINES: tuple[str, ...] = ("hf-assisted", "hf-pld")
#: Tokens prompt lookup copies per step (transformers' documented example value).
PLD_TOKENS = 10


class _CallCounter:
    """Counts a module's forward calls and the tokens they read while installed, and
    times the first call (generate's prefill: the prompt, with the first candidates)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self.tokens = 0
        self.first_call_s = 0.0
        self._device = next(module.parameters()).device
        self._start = 0.0
        self._handles = (
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            module.register_forward_hook(self._after, with_kwargs=True),
        )

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        self.tokens += int(ids.shape[1]) if ids is not None else 0
        if self.calls == 1:
            self._start = self._clock()

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if self.calls == 1:
            self.first_call_s = self._clock() - self._start

    def _clock(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class HFBaseline:
    """One transformers decoding method, run on one prompt at a time.

    Args:
        name: ``hf-assisted`` (the draft model as assistant) or ``hf-pld`` (prompt lookup).
        target, draft: the models (``draft`` only for ``hf-assisted``).
        stop_token_ids: generation stops after one of these, as in the engine.
    """

    def __init__(
        self,
        name: str,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        stop_token_ids: Sequence[int],
    ) -> None:
        if name not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES}, got {name!r}")
        if name == "hf-assisted" and draft is None:
            raise ValueError("hf-assisted needs a draft model")
        self.name = name
        self.target = target
        self.draft = draft
        self.stop_token_ids = list(stop_token_ids)

    @torch.inference_mode()
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[RequestOutput, float]:
        """Greedy generation; returns the output and its wall time in seconds."""
        device = next(self.target.parameters()).device
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.stop_token_ids or None,
            pad_token_id=self.stop_token_ids[0] if self.stop_token_ids else 0,
        )
        extra: dict[str, object] = {}
        if self.name == "hf-assisted":
            extra["assistant_model"] = self.draft
        else:
            config.prompt_lookup_num_tokens = PLD_TOKENS
        ids = torch.tensor([list(prompt)], dtype=torch.int64, device=device)
        target_calls = _CallCounter(self.target)
        draft_calls = _CallCounter(self.draft) if self.draft is not None else None
        try:
            start = time.perf_counter()
            out = self.target.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra
            )
            seconds = time.perf_counter() - start
        finally:
            target_calls.remove()
            if draft_calls is not None:
                draft_calls.remove()
        tokens = out[0, ids.shape[1] :].tolist()
        stop = frozenset(self.stop_token_ids)
        result = RequestOutput(
            token_ids=tokens,
            finish_reason="stop" if tokens and tokens[-1] in stop else "length",
            rounds=target_calls.calls,
            draft_forwards=draft_calls.calls if draft_calls is not None and self.name == "hf-assisted" else 0,
            verify_tokens=target_calls.tokens - ids.shape[1],
            prefill_s=target_calls.first_call_s,
        )
        return result, seconds
