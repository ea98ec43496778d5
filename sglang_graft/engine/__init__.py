"""The reference speculative decoder on Hugging Face transformers (CPU or CUDA).

The only package besides ``sglang_graft.cli`` that imports transformers; it drives the
pure-PyTorch core (scheduler, grafting, verification) end to end. Names are loaded on
first use, so importing ``sglang_graft.engine.config`` alone stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ENGINE_POLICIES": "config",
    "EngineConfig": "config",
    "SamplingConfig": "config",
    "use_cpu_kernel": "cpu_linear",
    "DecodeRun": "decoder",
    "SpecEngine": "decoder",
    "DraftOutput": "drafter",
    "Drafter": "drafter",
    "ModelDrafter": "drafter",
    "TINY": "models",
    "ModelPair": "models",
    "prepare_pair": "models",
    "tiny_models": "models",
    "tiny_pair": "models",
    "BatchOutput": "outputs",
    "RequestOutput": "outputs",
    "Totals": "outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sglang_graft.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sglang_graft.engine.{_EXPORTS[name]}"), name)
