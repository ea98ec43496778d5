"""sglang-graft: Graft's prune-then-graft speculation trees for SGLang.

The core (``tree``, ``prune``, ``graft``, ``verify``, ``calibration``, ``candidates``,
``scheduler``, ``retrieval``; ``compiled`` runs the same round as an AOTInductor package)
is plain PyTorch and imports neither SGLang nor transformers; the engine integrations live
in ``sglang_graft.engine`` (transformers) and ``sglang_graft.sglang``.
"""

__version__ = "0.1.0"
