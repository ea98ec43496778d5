"""Int8 linear layers on AMX tiles, for the int8 draft's wide forwards on Intel Xeons.

A drafted level feeds 8-20 tokens to the draft at once, and PyTorch's dynamic int8 linear
(FBGEMM on AVX512-VNNI) is compute-bound there: the Qwen2.5-Coder-0.5B draft's 168
matmuls cost 24 ms for 1 row, 37 for 8 and 47 for 19 on a 2-core Sapphire Rapids Xeon.
``csrc/int8_amx.cpp`` multiplies on AMX tiles, 16x the int8 work per instruction, so every
width up to 32 rows costs about what streaming the weights does: 16, 18 and 23 ms
(``scripts/bench_forward_cost.py --draft-int8`` measures whole forwards).

Weights are int8 per output channel, activations are quantized per row at each call
(``csrc/int8_amx.cpp`` says why), so the layer's outputs are close to, not equal to,
FBGEMM's; lossless decoding does not depend on either (the target verifies every token).

The library is compiled once with the host's C++ compiler into the kernel cache (as
``engine.cpu_linear``'s), and the process asks Linux for the AMX tile state before the
first call.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch  # imported before the library loads, so it links PyTorch's OpenMP runtime

from sglang_graft.engine.cpu_linear import build_library, cpu_flags

SOURCE = Path(__file__).parent / "csrc" / "int8_amx.cpp"
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mamx-tile", "-mamx-int8", "-fopenmp", "-shared", "-fPIC")
_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "amx_tile", "amx_int8"})
#: A layer runs on the tiles when its output and input sizes are multiples of these (two
#: 16-column weight blocks per tile pass, 64 bytes of K per tile row); others stay FBGEMM's.
OUT_MULTIPLE, IN_MULTIPLE = 32, 64


def amx_unavailable_reason() -> str | None:
    """Why the AMX kernel cannot run here, or None when it can (it is then built, loaded and
    the tile state granted)."""
    missing = sorted(_CPU_FLAGS - cpu_flags())
    if missing:
        return f"this CPU lacks {', '.join(missing)} (AMX int8 needs an Intel Xeon of the Sapphire Rapids generation or later)"
    try:
        _library()  # build_library names a missing compiler
    except (RuntimeError, OSError) as err:
        return str(err)
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    lib = build_library(SOURCE, _FLAGS, "AMX int8 kernel")
    lib.graft_amx_enable.restype = ctypes.c_int
    if lib.graft_amx_enable() != 0:
        raise RuntimeError("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM); a kernel older than 5.16?")
    lib.graft_amx_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
    lib.graft_amx_pack.restype = None
    lib.graft_amx_linear.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3
    lib.graft_amx_linear.restype = None
    return lib


def fits_amx(linear: torch.nn.Linear) -> bool:
    """Whether the kernel takes this layer's shape."""
    return linear.out_features % OUT_MULTIPLE == 0 and linear.in_features % IN_MULTIPLE == 0


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``(int8 [N, K], float32 scales [N])`` with
    ``weight ~ q * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class AmxInt8Linear(torch.nn.Module):
    """A linear layer with int8 weights whose forward runs ``csrc/int8_amx.cpp`` (float32 in
    and out, any leading dimensions). Build it with ``from_linear``; inference only."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "AmxInt8Linear":
        if not fits_amx(linear):
            raise ValueError(
                f"AMX int8 needs out_features % {OUT_MULTIPLE} == 0 and in_features % {IN_MULTIPLE} == 0, "
                f"got {linear.out_features} x {linear.in_features}"
            )
        q, scale = quantize_weight(linear.weight)
        packed = torch.empty_like(q)
        _library().graft_amx_pack(q.data_ptr(), packed.data_ptr(), q.shape[0], q.shape[1])
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        return cls(packed, scale.contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(
                f"AmxInt8Linear takes float32 CPU inputs with {self.in_features} features, "
                f"got {x.dtype} on {x.device} with {x.shape[-1]}"
            )
        rows = x.reshape(math.prod(x.shape[:-1]), self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        _library().graft_amx_linear(
            rows.data_ptr(),
            self.packed.data_ptr(),
            self.scale.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            self.out_features,
            self.in_features,
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
