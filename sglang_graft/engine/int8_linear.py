"""Int8 linear layers for the int8 draft's forwards, on AMX tiles or AVX512-VNNI.

A drafted level feeds 1-20 tokens to the draft at once, and PyTorch's dynamic int8 linear
(FBGEMM) is slow there: the Qwen2.5-Coder-0.5B draft's 168 matmuls cost 24 ms for 1 row,
37 for 8 and 47 for 19 on a 2-core Sapphire Rapids Xeon, 19 / 24 / 30 ms for 1 / 8 / 16
rows on a 2-core Zen 4 EPYC. ``csrc/int8_linear.cpp`` has two paths over one packed weight
layout (``KERNELS``):

* ``amx`` (Intel Sapphire Rapids and later): 16x the int8 work per instruction, so every
  width up to 32 rows costs about what streaming the weights does (16, 18 and 23 ms);
* ``vnni`` (AVX512-VNNI without AMX: AMD Zen 4, Intel Cascade/Ice Lake): register-blocked
  8 rows x 32 columns, weights prefetched 2 KB ahead (12 / 16 / 24 ms on the Zen 4 EPYC
  before the prefetch; 8.2 / 9.3 / 13.8 ms on a 2-core Zen 5 EPYC with it).

``scripts/bench_forward_cost.py --draft-int8 --int8-kernel K`` measures whole forwards.
Weights are int8 per output channel, activations are quantized per row at each call
(``csrc/int8_linear.cpp`` says why); both paths compute the same integer sums, so the
same layer's outputs agree to float rounding. They are close to, not equal to, FBGEMM's;
lossless decoding does not depend on either (the target verifies every token).

The library is compiled once with the host's C++ compiler into the kernel cache (as
``engine.cpu_linear``'s); for ``amx`` the process asks Linux for the tile state before the
first call.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch  # imported before the library loads, so it links PyTorch's OpenMP runtime

from sglang_graft.engine.cpu_linear import build_library, cpu_flags

SOURCE = Path(__file__).parent / "csrc" / "int8_linear.cpp"
DECODER_SOURCE = SOURCE.with_name("int8_decoder.cpp")
_FLAGS = (
    "-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vnni", "-mamx-tile", "-mamx-int8",
    "-fopenmp", "-shared", "-fPIC",
)  # fmt: skip
#: The kernels, with the CPU flags (``/proc/cpuinfo``) each needs and the CPUs that have them.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq"})
KERNELS = {
    "amx": (_AVX512 | {"amx_tile", "amx_int8"}, "an Intel Xeon of the Sapphire Rapids generation or later"),
    "vnni": (_AVX512 | {"avx512_vnni"}, "AVX512-VNNI: AMD Zen 4 or later, Intel Cascade Lake or later"),
}
#: A layer runs on the kernel when its output and input sizes are multiples of these (two
#: 16-column weight blocks per pass, 64 bytes of K per AMX tile row); others stay FBGEMM's.
OUT_MULTIPLE, IN_MULTIPLE = 32, 64


def unavailable_reason(kernel: str) -> str | None:
    """Why ``kernel`` (a ``KERNELS`` key) cannot run here, or None when it can (it is then
    built and loaded, and for ``amx`` the tile state granted)."""
    needs, which = KERNELS[kernel]
    missing = sorted(needs - cpu_flags())
    if missing:
        return f"this CPU lacks {', '.join(missing)} (the {kernel} int8 kernel needs {which})"
    try:
        library()  # build_library names a missing compiler
        if kernel == "amx":
            _enable_amx()
    except (RuntimeError, OSError) as err:
        return str(err)
    return None


@functools.cache
def library() -> ctypes.CDLL:
    """The int8 kernel library (built once), with the draft layer's calls (``engine.int8_decoder``)."""
    lib = build_library(SOURCE, _FLAGS, "int8 linear kernel", (DECODER_SOURCE,))
    lib.graft_amx_enable.restype = ctypes.c_int
    lib.graft_int8_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
    lib.graft_int8_pack.restype = None
    lib.graft_amx_linear.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3
    lib.graft_amx_linear.restype = None
    lib.graft_vnni_linear.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3
    lib.graft_vnni_linear.restype = None
    return lib


@functools.cache
def _enable_amx() -> None:
    if library().graft_amx_enable() != 0:
        raise RuntimeError("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM); a kernel older than 5.16?")


def fits(linear: torch.nn.Linear) -> bool:
    """Whether the kernels take this layer's shape."""
    return linear.out_features % OUT_MULTIPLE == 0 and linear.in_features % IN_MULTIPLE == 0


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``(int8 [N, K], float32 scales [N])`` with
    ``weight ~ q * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights whose forward runs ``csrc/int8_linear.cpp`` (float32
    in and out, any leading dimensions). Build it with ``from_linear``; inference only.

    ``comp`` is ``vnni``'s correction (128 times each output channel's weight sum: VNNI
    multiplies unsigned activations, so the kernel shifts them by 128); None for ``amx``.
    """

    def __init__(
        self, kernel: str, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, comp: torch.Tensor | None
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"int8 kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if (comp is None) != (kernel == "amx"):
            raise ValueError(f"the {kernel} kernel {'takes no' if kernel == 'amx' else 'needs a'} weight-sum correction")
        self.kernel = kernel
        self.out_features, self.in_features = packed.shape
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.register_buffer("comp", comp)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, kernel: str) -> "Int8Linear":
        if not fits(linear):
            raise ValueError(
                f"the int8 kernels need out_features % {OUT_MULTIPLE} == 0 and in_features % {IN_MULTIPLE} == 0, "
                f"got {linear.out_features} x {linear.in_features}"
            )
        q, scale = quantize_weight(linear.weight)
        packed = torch.empty_like(q)
        library().graft_int8_pack(q.data_ptr(), packed.data_ptr(), q.shape[0], q.shape[1])
        comp = None if kernel == "amx" else 128 * q.sum(dim=1, dtype=torch.int32)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        return cls(kernel, packed, scale.contiguous(), bias, comp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Int8Linear takes float32 CPU inputs with {self.in_features} features, "
                f"got {x.dtype} on {x.device} with {x.shape[-1]}"
            )
        rows = x.reshape(math.prod(x.shape[:-1]), self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        bias = None if self.bias is None else self.bias.data_ptr()
        args = (rows.shape[0], self.out_features, self.in_features)
        x_ptr, w_ptr, scale_ptr, out_ptr = rows.data_ptr(), self.packed.data_ptr(), self.scale.data_ptr(), out.data_ptr()
        if self.kernel == "amx":
            _enable_amx()
            library().graft_amx_linear(x_ptr, w_ptr, scale_ptr, bias, out_ptr, *args)
        else:
            library().graft_vnni_linear(x_ptr, w_ptr, self.comp.data_ptr(), scale_ptr, bias, out_ptr, *args)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"kernel={self.kernel}, {sizes}, bias={self.bias is not None}"
