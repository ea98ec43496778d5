"""Linear layers through the project's own CPU kernels where PyTorch's are slow.

On CPUs without native bf16 matmul (AMD Zen 2/3, Intel before Cooper Lake) PyTorch's bf16
``F.linear`` runs at about 12 GFLOP/s whatever the row count (measured on a 2-core AMD
EPYC, Zen 2): a target verify over 8 tokens costs 6.4 one-token decode steps, a 512-token
draft prefill 34 s, and speculation cannot pay. Its float32 linear (MKL) is slow from 2 to
16 rows too (2 tokens cost 1.8 decode steps). ``csrc/cpu_linear.cpp`` (AVX2) reads the
weights as loaded (bf16 or float32, no copy) and computes in float32: at one row it
streams the weights at the memory bandwidth, and from 2 to 16 rows it runs 5-6x faster
than the bf16 path.

On CPUs with AVX512-BF16 but no AMX (AMD Zen 4, Intel Cooper Lake) PyTorch's bf16 path is
native but slow at one row and steep above eight: the 1.5B target's linear layers took
195 ms for one token and 293 for sixteen on a 2-core Zen 4 EPYC. There bf16 x bf16
products take ``csrc/bf16_dot_linear.cpp`` (VDPBF16PS, 32 bf16 pairs per instruction,
float32 accumulation, weights as loaded): 119-135 ms for one token, 197-218 for sixteen.
A model's bf16 layers (``KernelLinear``) go one step further: each keeps a copy of its
weight repacked into panels of 32 output columns (``csrc/bf16_panel_linear.cpp``), one
sequential stream whose every load serves all of a call's rows, so the model's weights are
held twice. On a 2-core Zen 5 EPYC the 1.5B target's linear layers then took 44.3 instead
of 53.7 ms for one token and 65.1 instead of 80.8 for twelve, and its 384-token prefill
chunks run faster than on PyTorch's oneDNN GEMM. On AMX CPUs PyTorch's own bf16 path is
fast at every count and ``auto`` keeps it.

Every output is one fixed-order float32 sum, whichever rows share the call, so the linear
layers give a token bitwise the same outputs in a one-token decode step as in a tree
verify (on the AVX512-BF16 path's weights as loaded, calls of up to ``BF16_DOT_MAX_ROWS``
rows: longer ones are PyTorch's; panels take every row count, prefills included). Plain
decoding and every speculative policy run the same layers (and so do transformers'
baselines in a bench), so the comparison stays fair.

The kernels are compiled once per source version with the host's C++ compiler (a few
seconds) into ``$SGLANG_GRAFT_CACHE/kernels`` (default ``~/.cache/sglang-graft/kernels``) and
loaded with ctypes; their OpenMP threads are PyTorch's own (``torch.set_num_threads``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch  # imported before the library loads, so it links PyTorch's OpenMP runtime

from sglang_graft.compiled import cache_root

log = logging.getLogger(__name__)

CPU_KERNEL_MODES = ("auto", "on", "off")
SOURCE = Path(__file__).parent / "csrc" / "cpu_linear.cpp"
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
BF16_DOT_SOURCE = Path(__file__).parent / "csrc" / "bf16_dot_linear.cpp"
BF16_PANEL_SOURCE = Path(__file__).parent / "csrc" / "bf16_panel_linear.cpp"
_BF16_DOT_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
#: What the bf16 x bf16 path needs from the CPU (``/proc/cpuinfo`` flags).
BF16_DOT_NEEDS = frozenset({"avx512f", "avx512bw", "avx512_bf16"})
#: Rows from which a bf16 x bf16 call goes to PyTorch's own bf16 GEMM (oneDNN) instead,
#: where the CPU has the AVX512-BF16 path: a prefill's hundreds of rows run faster there
#: (the 1.5B target's linear layers over 512 rows: 3.5 against 5.2 s on a 2-core Zen 4;
#: they tie at 64 rows). Decode steps and verifies stay below it, so they keep the kernel's
#: batch-invariant sums.
BF16_DOT_MAX_ROWS = 64
_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(flags: frozenset[str]) -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX), which PyTorch then uses."""
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def _platform_problem() -> str | None:
    """What this machine lacks to build and run the kernel, or None."""
    if not {"avx2", "fma"} <= cpu_flags():
        return "this CPU lacks AVX2/FMA (or /proc/cpuinfo is unreadable)"
    if cxx_compiler() is None:
        return "no C++ compiler found (install g++, or set CXX)"
    return None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can (it is then built and loaded)."""
    problem = _platform_problem()
    if problem is not None:
        return problem
    try:
        _library()
    except (RuntimeError, OSError) as err:
        return f"building it failed: {err}"
    return None


def wants_cpu_kernel(mode: str, dtype: torch.dtype, device: str) -> bool:
    """Whether to run linear layers through the kernels under ``--cpu-kernel mode``; when
    True, they are built and loaded.

    ``auto``: on a CPU device, for float32 models, and for bf16 models where the CPU has no
    AMX (there PyTorch's own bf16 path is fast at every row count); where the kernel cannot
    run, it logs why and answers False. ``on`` insists and raises ``ValueError`` naming what is
    missing; ``off``: never.
    """
    if mode not in CPU_KERNEL_MODES:
        raise ValueError(f"--cpu-kernel must be one of {CPU_KERNEL_MODES}, got {mode!r}")
    if mode == "off":
        return False
    if not device.startswith("cpu"):
        problem = f"the models are on {device!r}, not the CPU"
    elif dtype not in _WEIGHT_DTYPES:
        problem = f"the kernel reads bfloat16 or float32 weights, the models are {dtype}"
    elif mode == "auto" and dtype == torch.bfloat16 and "amx_bf16" in cpu_flags():
        return False
    else:
        problem = unavailable_reason()
        if problem is not None and mode == "auto":
            _warn_fallback(problem)
    if problem is None:
        return True
    if mode == "on":
        raise ValueError(f"--cpu-kernel on: {problem}; use --cpu-kernel off or auto")
    return False


@functools.cache
def _warn_fallback(problem: str) -> None:
    """Say once per process why ``auto`` falls back (the CLI asks before choosing the dtype
    and again when loading)."""
    log.warning("--cpu-kernel auto: PyTorch's own linear layers run instead of the CPU kernel: %s", problem)


def cxx_compiler() -> str | None:
    """The C++ compiler the kernels build with ($CXX, else g++ or c++), or None."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def build_library(source: Path, flags: tuple[str, ...], what: str, extra_sources: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """Compile ``source`` (with ``extra_sources``, into the same library) with ``flags``
    (once per version of the sources and flags) into ``$SGLANG_GRAFT_CACHE/kernels`` and
    load it; ``what`` names the kernel in logs and errors. Import torch first, so the library
    links PyTorch's OpenMP runtime."""
    if cxx_compiler() is None:
        raise RuntimeError(f"the {what} needs a C++ compiler (install g++, or set CXX)")
    sources = (source, *extra_sources)
    # The headers beside the source count too: a kernel includes them.
    headers = sorted(source.parent.glob("*.h"))
    text = b"".join(f.read_bytes() for f in (*sources, *headers))
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    folder = cache_root() / "kernels"
    path = folder / f"{source.stem}-{digest}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        log.info("compiling the %s into %s (once)", what, path)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            out = Path(tmp) / path.name
            cmd = [str(cxx_compiler()), *flags, *map(str, sources), "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"compiling the {what} failed ({' '.join(cmd)}):\n{done.stderr}")
            os.replace(out, path)  # atomic: a concurrent build never loads a half-written file
    return ctypes.CDLL(str(path))


@functools.cache
def _library() -> ctypes.CDLL:
    """Build (once per source version) and load the kernel library."""
    problem = _platform_problem()
    if problem is not None:
        raise RuntimeError(f"the CPU linear kernel cannot run here: {problem}")
    lib = build_library(SOURCE, _FLAGS, "CPU linear kernel")
    lib.graft_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
    lib.graft_linear.restype = None
    return lib


def optional_library(
    source: Path,
    flags: tuple[str, ...],
    needs: frozenset[str],
    what: str,
    fallback: str,
    extra_sources: tuple[Path, ...] = (),
) -> ctypes.CDLL | None:
    """``build_library`` where the CPU has every flag of ``needs``; None where it lacks one
    or the build fails, logged with ``fallback`` (what runs instead)."""
    missing = needs - cpu_flags()
    if missing:
        log.info("the %s cannot run here (the CPU lacks %s): %s", what, ", ".join(sorted(missing)), fallback)
        return None
    try:
        return build_library(source, flags, what, extra_sources)
    except (RuntimeError, OSError) as err:
        log.warning("the %s is unavailable, %s: %s", what, fallback, err)
        return None


@functools.cache
def _bf16_dot_library() -> ctypes.CDLL | None:
    """The AVX512-BF16 library for bf16 x bf16 products (weights as loaded, and repacked into
    panels), built and loaded once; None where the CPU lacks AVX512-BF16 or the build fails
    (logged: the AVX2 path runs instead)."""
    lib = optional_library(
        BF16_DOT_SOURCE,
        _BF16_DOT_FLAGS,
        BF16_DOT_NEEDS,
        "AVX512-BF16 linear kernel",
        "bf16 layers take the AVX2 path",
        (BF16_PANEL_SOURCE,),
    )
    if lib is not None:
        for name, args, result in (
            ("graft_bf16_dot_linear", [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3, None),
            ("graft_bf16_panel_linear", [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3, None),
            ("graft_bf16_pack_panels", [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2, None),
            ("graft_bf16_panel_bytes", [ctypes.c_long] * 2, ctypes.c_long),
        ):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = result
    return lib


def bf16_dot_available() -> bool:
    """Whether bf16 x bf16 products take the AVX512-BF16 path here (it is then built and loaded)."""
    return _bf16_dot_library() is not None


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the kernel, accumulated in float32 and returned
    in ``x``'s dtype (bfloat16 or float32). ``weight`` is a contiguous ``[N, K]`` bfloat16 or
    float32 CPU tensor; ``bias`` takes its dtype. bf16 activations times bf16 weights run on
    the AVX512-BF16 path where the CPU has it (calls of more than ``BF16_DOT_MAX_ROWS`` rows
    on PyTorch's bf16 GEMM there), everything else on the AVX2 path."""
    if weight.dtype not in _WEIGHT_DTYPES or weight.device.type != "cpu" or not weight.is_contiguous():
        raise ValueError(
            f"cpu_linear needs a contiguous bfloat16 or float32 CPU weight, got {weight.dtype} on "
            f"{weight.device} (contiguous: {weight.is_contiguous()})"
        )
    if x.dtype not in _WEIGHT_DTYPES or x.device.type != "cpu":
        raise ValueError(f"cpu_linear takes bfloat16 or float32 CPU activations, got {x.dtype} on {x.device}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"cpu_linear: input has {x.shape[-1]} features, the weight expects {k}")
    m = math.prod(x.shape[:-1])
    bf16_dot = _bf16_dot_library() if x.dtype == weight.dtype == torch.bfloat16 else None
    if bf16_dot is not None and m > BF16_DOT_MAX_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    rows = x.reshape(m, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    b = None if bias is None else bias.to(weight.dtype).contiguous()
    if bf16_dot is not None:
        bf16_dot.graft_bf16_dot_linear(
            rows.data_ptr(), weight.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(), rows.shape[0], n, k
        )
        return out.reshape(*x.shape[:-1], n)
    _library().graft_linear(
        rows.data_ptr(),
        weight.data_ptr(),
        None if b is None else b.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        n,
        k,
        int(x.dtype == torch.bfloat16),
        int(weight.dtype == torch.bfloat16),
    )
    return out.reshape(*x.shape[:-1], n)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``[N, K]`` CPU weight repacked for ``panel_linear`` (a flat bf16 tensor):
    panels of 32 output columns, each k pair of the 32 side by side, zeros past N and an odd
    K (``csrc/bf16_panel_linear.cpp``). Needs the AVX512-BF16 library."""
    lib = _bf16_dot_library()
    if lib is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels needs a bf16 CPU weight and AVX512-BF16, got {weight.dtype} on {weight.device}")
    n, k = weight.shape
    w = weight.contiguous()
    packed = torch.empty(lib.graft_bf16_panel_bytes(n, k) // 2, dtype=torch.bfloat16)
    lib.graft_bf16_pack_panels(w.data_ptr(), packed.data_ptr(), n, k)
    return packed


def panel_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bf16 ``x`` from ``pack_panels(weight)`` (``n``: the
    weight's rows), every row count through the panel kernel: a row's outputs are bitwise
    the same whichever rows share the call."""
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    rows = x.reshape(m, k).contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    if m:
        _bf16_dot_library().graft_bf16_panel_linear(
            rows.data_ptr(), packed.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(), m, n, k
        )
    return out.reshape(*x.shape[:-1], n)


LinearT = TypeVar("LinearT", bound=torch.nn.Linear)


def share_linear(cls: type[LinearT], linear: torch.nn.Linear) -> LinearT:
    """A ``cls`` layer (``nn.Linear`` or a subclass) sharing ``linear``'s parameters: no
    copy, and tied weights stay tied."""
    out = cls.__new__(cls)
    torch.nn.Module.__init__(out)
    out.in_features, out.out_features = linear.in_features, linear.out_features
    out.weight = linear.weight
    out.bias = linear.bias
    return out


def replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put ``module`` where ``model.get_submodule(name)`` was."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


class KernelLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward runs the project's kernels (build one with ``share_linear``).

    A bf16 layer on a CPU with AVX512-BF16 keeps a copy of its weight repacked into panels
    and runs every bf16 call through ``panel_linear``; the copy is made by ``panels()`` (which
    ``use_cpu_kernel`` calls, so a model pays it at load) and again whenever the weight is
    no longer the one packed (moved, cast, copied or written into). Other layers run
    ``cpu_linear`` on the weight as loaded. Inference only: with gradients enabled it falls
    back to ``F.linear``.
    """

    use_panels = True  # False: bf16 calls run on the weight as loaded (``use_cpu_kernel`` when memory is short)
    _packed: torch.Tensor | None = None
    _packed_from: tuple[int, int] | None = None  # the packed weight's (data pointer, version)

    def panels(self) -> torch.Tensor | None:
        """The weight in panels (packed now if it changed since), or None where they do not apply."""
        w = self.weight
        if not self.use_panels or w.dtype != torch.bfloat16 or w.device.type != "cpu" or _bf16_dot_library() is None:
            return None
        # Inference tensors (made under torch.inference_mode) have no version counter: their
        # data pointer alone names them, so an in-place write to one goes unnoticed (load
        # weights before ``use_cpu_kernel``).
        source = (w.data_ptr(), -1 if w.is_inference() else w._version)
        if self._packed_from != source:
            self._packed, self._packed_from = pack_panels(w), source
        return self._packed

    def __getstate__(self) -> dict:
        # A copy (``int8_draft`` deep-copies the draft) packs its own weight when it first needs to.
        state = super().__getstate__()
        state.pop("_packed", None)
        state.pop("_packed_from", None)
        return state

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> KernelLinear:
        # Moved or cast (``.to``, ``.float``): the old panels go now, not at the next call.
        self._packed, self._packed_from = None, None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        packed = self.panels() if x.dtype == torch.bfloat16 else None
        if packed is not None:
            return panel_linear(x, packed, self.out_features, self.bias)
        return cpu_linear(x, self.weight, self.bias)


#: Share of the host's available memory the panels may take; past it a model's layers keep
#: running on their weights as loaded, so packing never pushes the host into swap.
PANEL_MEMORY_SHARE = 0.5


def available_memory() -> int | None:
    """Bytes of memory the host can still give (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def use_cpu_kernel(model: torch.nn.Module) -> int:
    """Run every plain ``nn.Linear`` of ``model`` (bf16 or float32) through the kernel, in
    place; returns how many layers now do. The library is built and loaded here, and bf16
    layers are packed into panels where the CPU has AVX512-BF16 and the panels fit in
    ``PANEL_MEMORY_SHARE`` of the available memory (logged either way), so a problem shows,
    and the packing is paid, before any decoding."""
    _library()
    layers = []
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear and module.weight.dtype in _WEIGHT_DTYPES and module.weight.is_contiguous():
            layers.append(share_linear(KernelLinear, module))
            replace_module(model, name, layers[-1])
    packable = [layer for layer in layers if layer.weight.dtype == torch.bfloat16 and _bf16_dot_library() is not None]
    if packable:
        lib = _bf16_dot_library()
        need = sum(lib.graft_bf16_panel_bytes(layer.out_features, layer.in_features) for layer in packable)
        free = available_memory()
        what = f"{type(model).__name__}'s bf16 linear layers"
        if free is not None and need > PANEL_MEMORY_SHARE * free:
            for layer in packable:
                layer.use_panels = False
            log.warning(
                "%s stay on their weights as loaded (slower): their panels would take %.2f GB, more than %.0f%% "
                "of the %.2f GB available",
                what, need / 1e9, 100 * PANEL_MEMORY_SHARE, free / 1e9,
            )
        else:
            for layer in packable:
                layer.panels()
            log.info("packed %s into panels (%.2f GB beside the weights)", what, need / 1e9)
    return len(layers)
