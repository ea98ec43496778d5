"""An int8 draft model for CPU hosts: most of its matmuls as dynamic int8, the rest as loaded.

On a 2-core CPU a 0.5B bf16 draft forward over 4 tokens costs about a third of the 1.5B
target's verify, and a graft round spends ~40% of its time in draft forwards. PyTorch's
dynamic int8 linear (weights int8 per output channel, activations quantized per call)
runs the same forward in about half the time (Qwen2.5-Coder-0.5B decoder at 300 tokens of
context: 28 against 56 ms for 4 new tokens, 34 against 53 for 8, measured).

Losslessness does not depend on the draft's precision (the target verifies every token),
only speed does, through how often the target agrees with the draft. Outside the matmuls
(embeddings, norms, attention) the quantized draft computes in float32, the dtype
PyTorch's quantized kernels take.

What int8 must not read is a sequence's first token: its hidden state carries a few huge
activation channels (the attention sink every later token attends to), which the MLP
output projection (``down_proj``) reads and a per-tensor activation scale clips. Dynamic
int8 wins on the few rows a drafted level feeds, not on long spans: where the CPU
multiplies bf16 natively, the loaded bf16 draft reads 64 new tokens as fast as the int8
one and 256 in two thirds of its time (212 against 311 ms; a 709-token Spec-Bench prompt
0.60 against 1.35 s, 2-core Xeon with AMX). So there an int8 draft keeps a reference to
the model it came from, which reads the prompt (``span_reader``), and every matmul but the
LM head is int8; the same holds when that model runs the project's CPU kernel on its
AVX512-BF16 path (on a 2-core Zen 4 EPYC the int8 draft's 8-token forward then took 37 ms
instead of 60 with a bf16 ``down_proj``; the bf16 reader read 512 tokens in 1.45 s, the
int8 draft in 1.40). Teacher-forced top-1 agreement with the target's greedy tokens (18
Spec-Bench questions, 48 tokens each, 658 positions, 2-core AMX Xeon): 0.786 with an int8
``down_proj``, 0.784 with a bf16 one, at 53 against 66 ms per one-token forward; had the
int8 draft read the prompts itself, 0.748 against 0.783. Where no bf16 reader is at hand (no native bf16, or
the CPU kernel's AVX2 path, which widens bf16 to float32), the int8 draft reads the prompt
itself and keeps ``down_proj`` in the loaded dtype (``CastLinear``, or ``KernelLinear``):
quantizing it there had the target's greedy token be the draft's top-1 on 62% of
Spec-Bench positions instead of 77%.
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings

import torch

from sglang_graft.engine.int8_decoder import fuse_int8_layers
from sglang_graft.engine.int8_linear import KERNELS, Int8Linear, fits, unavailable_reason
from sglang_graft.engine.cpu_linear import (
    KernelLinear,
    bf16_dot_available,
    cpu_flags,
    native_bf16,
    replace_module,
    share_linear,
)

log = logging.getLogger(__name__)

#: ``--int8-kernel`` choices: ``amx`` and ``vnni`` run the int8 layers whose shapes they
#: take on the project's kernel (``engine.int8_linear``: AMX tiles, AVX512-VNNI), ``fbgemm``
#: all of them through PyTorch's dynamic int8 linear, ``auto`` picks the first of ``amx``,
#: ``vnni``, ``fbgemm`` that can run.
INT8_KERNELS = ("auto", *KERNELS, "fbgemm")

#: Linear layers left in the loaded dtype when the int8 draft reads prompts itself, by the
#: last part of their module name: the MLP output projection of Llama/Qwen-style decoders
#: (see the module docstring).
KEPT_LINEARS = ("down_proj",)


class CastLinear(torch.nn.Linear):
    """A linear layer that keeps its weights, and computes, in their own dtype whatever its
    input's; the output comes back in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def is_int8_draft(model: torch.nn.Module) -> bool:
    """Whether ``model`` came from ``int8_draft``."""
    return bool(getattr(model, "_graft_int8_draft", False))


def resolve_int8_kernel(kernel: str) -> str:
    """``amx``, ``vnni`` or ``fbgemm`` for an ``--int8-kernel`` choice; ``ValueError`` for
    an unknown one, or for ``amx`` or ``vnni`` where it cannot run (naming why)."""
    if kernel not in INT8_KERNELS:
        raise ValueError(f"--int8-kernel must be one of {', '.join(INT8_KERNELS)}, got {kernel!r}")
    if kernel == "fbgemm":
        return kernel
    if kernel != "auto":
        problem = unavailable_reason(kernel)
        if problem is not None:
            raise ValueError(f"--int8-kernel {kernel}: {problem}; use --int8-kernel fbgemm or auto")
        return kernel
    problems = []
    for candidate in KERNELS:
        problem = unavailable_reason(candidate)
        if problem is None:
            return candidate
        problems.append(problem)
    _say_fallback("; ".join(problems))
    return "fbgemm"


@functools.cache
def _say_fallback(problem: str) -> None:
    log.info("--int8-kernel auto: the int8 draft runs PyTorch's dynamic int8 linear (FBGEMM): %s", problem)


def int8_kernel(model: torch.nn.Module) -> str | None:
    """Which kernel an ``int8_draft`` runs (``amx``, ``vnni`` or ``fbgemm``); None for other models."""
    return getattr(model, "_graft_int8_kernel", None)


def int8_draft(model: torch.nn.Module, kernel: str = "auto") -> torch.nn.Module:
    """An int8 copy of a draft causal LM on the CPU (``model`` itself is left as it was).

    Every ``nn.Linear`` becomes an int8 linear (per-channel weights, activations quantized
    per call) except the LM head and, unless ``model`` can read the prompts
    (``reads_spans``), the ``KEPT_LINEARS``: those keep the loaded dtype and share the
    loaded model's weights (``CastLinear``, or ``KernelLinear`` when the model runs the CPU
    kernel; the LM head stays a linear layer that ``DraftHead`` can slice). The int8 layers
    run on the project's kernel where ``kernel`` (``INT8_KERNELS``) resolves to ``amx`` or
    ``vnni`` and their shape fits, else through PyTorch's dynamic int8 linear; decoder
    layers whose projections all run on the kernel then run as ``FusedInt8Layer``s. Raises
    ``ValueError`` for a model off the CPU, where PyTorch has no dynamic int8 kernels, and for
    a ``kernel`` that cannot run.
    """
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"--draft-int8 runs on the CPU only (PyTorch's dynamic int8 kernels); the draft is on {device}")
    if is_int8_draft(model):
        return model
    kernel = resolve_int8_kernel(kernel)
    head = model.get_output_embeddings()
    reader = model if reads_spans(model) else None
    kept_names = () if reader is not None else KEPT_LINEARS
    kept = {
        name: share_linear(KernelLinear if isinstance(m, KernelLinear) else CastLinear, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and (m is head or name.rsplit(".", 1)[-1] in kept_names)
    }
    out = copy.deepcopy(model).float()
    # The other layers are quantized, which takes plain nn.Linear modules.
    swaps = {**{n: share_linear(torch.nn.Linear, m) for n, m in out.named_modules() if type(m) is KernelLinear}, **kept}
    for name, linear in swaps.items():
        replace_module(out, name, linear)
    if kernel in KERNELS:
        for name, m in list(out.named_modules()):
            if type(m) is torch.nn.Linear and fits(m):
                replace_module(out, name, Int8Linear.from_linear(m, kernel))
    quantized = {
        name: torch.ao.quantization.per_channel_dynamic_qconfig
        for name, m in out.named_modules()
        if type(m) is torch.nn.Linear
    }
    with warnings.catch_warnings():  # torch.ao's notice that eager quantization moves to torchao
        warnings.simplefilter("ignore")
        out = torch.ao.quantization.quantize_dynamic(out, quantized, dtype=torch.qint8, inplace=True)
    if kernel in KERNELS:
        fused = fuse_int8_layers(out)
        log.info("int8 draft on the %s kernel: %d decoder layers run as two kernel calls each", kernel, fused)
    out._graft_int8_draft = True
    out._graft_int8_kernel = kernel
    # A plain attribute, not a submodule: the reader's parameters stay out of this model's.
    # It keeps the loaded model alive, which the caller (ModelPair, bench) holds anyway.
    out.__dict__["_graft_reader"] = reader
    return out.eval()


def reads_spans(model: torch.nn.Module) -> bool:
    """Whether a loaded draft should read the prompts for its ``int8_draft`` copy: it is
    bf16, the CPU multiplies bf16 natively and the model's matmuls are native bf16 ones
    (PyTorch's own, or the CPU kernel's AVX512-BF16 path); elsewhere (the kernel's AVX2
    path widening bf16 to float32) the int8 copy is the faster reader."""
    if model.get_input_embeddings().weight.dtype != torch.bfloat16 or not native_bf16(cpu_flags()):
        return False
    return not any(isinstance(m, KernelLinear) for m in model.modules()) or bf16_dot_available()


def span_reader(draft: torch.nn.Module) -> torch.nn.Module | None:
    """The model that reads a drafter's first span (the prompt) and later long spans of
    unread tokens for ``draft``: the bf16 model an ``int8_draft`` came from, when
    ``reads_spans`` said so at quantization; None where ``draft`` reads everything itself."""
    return draft.__dict__.get("_graft_reader") if is_int8_draft(draft) else None
