"""Masked grouped-query attention on the CPU without copying the KV heads.

Every forward of the reference engine passes an explicit 4D mask (left padding, draft
trees, verify trees), and so does transformers' own generation for any multi-token step.
With a mask, transformers' ``sdpa`` attention repeats each KV head ``heads / kv_heads``
times (``repeat_kv``) before calling PyTorch's SDPA, because CUDA's fused kernels take no
mask with grouped-query attention. On the CPU that copy is most of the attention's cost:
Qwen2.5-Coder-1.5B repeats its 2 KV heads to 12, a 5.5 MB copy per layer at 900 tokens of
context, and a one-token forward with a mask cost 237 ms against 224 ms without one on a
2-core Xeon. PyTorch's CPU flash attention takes the mask and ``enable_gqa`` together,
so this implementation passes both and copies nothing; elsewhere it is transformers' own.

Blocks of up to ``SMALL_BLOCK`` query tokens (decode steps, draft levels, verifies) skip
SDPA on the CPU: its bf16 flash kernel is slow for few queries over a long cache (one
query over 900 cached tokens: 0.93 ms per layer on a 2-core Zen 5 EPYC, a fifth of the
1.5B target's decode step, where two matmuls and a softmax in float32 take 0.10 ms; 8
queries 0.41 against 0.30 ms). ``small_block_attention`` computes the same attention in at
least float32, each KV head serving its group of query heads through one matmul.

On CPUs with AVX512 (``SMALL_ATTENTION_NEEDS``) those blocks run in one pass of the
project's kernel instead (``csrc/small_attention.cpp``, ``small_attention``): 8 queries of
the 1.5B target over 700 cached tokens 98 against 260 us a layer, one query 31 against 94
(2-core Zen 5 EPYC, bf16). A query's output there does not depend on which other queries
share the block, nor on the keys it does not see, so with the project's linear kernels
(``engine.cpu_linear``) a bf16 tree verify gives each path token the logits its one-token
decode step would, bit for bit, and greedy speculation equals plain decoding exactly.
Where the CPU also has AVX512-BF16, the kernel is built to take bf16 scores from VDPBF16PS
on pairs of elements (half the multiply instructions, no widened keys: 1.2-1.5x faster per
layer on a 2-core Zen 4 EPYC, more the longer the cache); every claim above holds for both
builds (tests/test_small_attention.py checks each).
``use_gqa_attention(model, kernel=False)`` keeps PyTorch's ops.

The models the CLI and the benchmark load all use it, transformers' baselines included
(they share the loaded target and draft), so every method measures the same attention.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sglang_graft.engine.cpu_linear import cpu_flags, optional_library

#: The name under which ``gqa_sdpa_forward`` is registered with transformers.
GQA_SDPA = "graft_gqa_sdpa"
#: ... and ``gqa_sdpa_forward`` with ``kernel=True``: small blocks through ``small_attention``.
GQA_KERNEL = "graft_gqa_kernel"
#: Query blocks up to this many tokens take ``small_block_attention`` on the CPU.
SMALL_BLOCK = 32
SMALL_ATTENTION_SOURCE = Path(__file__).parent / "csrc" / "small_attention.cpp"
_SMALL_ATTENTION_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-fopenmp", "-shared", "-fPIC")
#: What the small-block attention kernel needs from the CPU (``/proc/cpuinfo`` flags).
SMALL_ATTENTION_NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl"})
#: Where the CPU also has this flag, the kernel is built to score bf16 queries with VDPBF16PS.
SMALL_ATTENTION_PAIRS_FLAG = "avx512_bf16"
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def small_block_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention of a few queries: ``[bs, heads, q, d]`` query, ``[bs,
    kv_heads, L, d]`` key/value, ``mask`` None or ``[bs, 1, q, L]`` (bool: True attends;
    else added to the scores); returns ``[bs, heads, q, d]`` in the query's dtype.

    Query head ``j`` reads KV head ``j // (heads / kv_heads)``, as SDPA's ``enable_gqa``
    does; scores, softmax and the weighted sum run in float32 (float64 for float64 models).
    """
    bs, heads, q, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.reshape(bs, kv_heads, group * q, d).to(dtype), key.to(dtype).transpose(-1, -2))
    scores = scores.mul_(scale).view(bs, kv_heads, group, q, -1)
    if mask is not None:
        if mask.dtype == torch.bool:
            # The dtype's lowest, not -inf: a row with nothing to attend stays finite (uniform).
            scores.masked_fill_(~mask.unsqueeze(1), torch.finfo(dtype).min)
        else:
            scores.add_(mask.unsqueeze(1).to(dtype))
    probs = torch.softmax(scores, dim=-1).view(bs, kv_heads, group * q, -1)
    return torch.matmul(probs, value.to(dtype)).view(bs, heads, q, d).to(query.dtype)


@functools.cache
def _small_attention_library(pairs: bool | None = None) -> ctypes.CDLL | None:
    """The kernel library, built and loaded once; None where the CPU lacks AVX512 or the
    build fails (logged: PyTorch's ops run instead). With ``pairs`` it is built with
    AVX512-BF16, which scores bf16 queries by VDPBF16PS (the csrc file says how that rounds);
    None: where the CPU has it."""
    if pairs is None:
        pairs = SMALL_ATTENTION_PAIRS_FLAG in cpu_flags()
    lib = optional_library(
        SMALL_ATTENTION_SOURCE,
        _SMALL_ATTENTION_FLAGS + (("-mavx512bf16",) if pairs else ()),
        SMALL_ATTENTION_NEEDS | ({SMALL_ATTENTION_PAIRS_FLAG} if pairs else set()),
        "small-block attention kernel" + (" (bf16 pairs)" if pairs else ""),
        "PyTorch's ops run instead",
    )
    if lib is not None:
        pointers = [ctypes.c_void_p] * 4
        sizes = [ctypes.c_long] * 6
        lib.graft_small_attention.argtypes = pointers + [ctypes.c_int, ctypes.c_void_p] + sizes + [
            ctypes.c_void_p,  # strides
            ctypes.c_float,
            ctypes.c_int,
        ]
        lib.graft_small_attention.restype = None
    return lib


def small_attention_available() -> bool:
    """Whether small query blocks can take the kernel here (it is then built and loaded)."""
    return _small_attention_library() is not None


def small_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor | None:
    """``small_block_attention`` through the kernel, returned as ``[bs, q, heads, d]`` (the
    layout ``o_proj`` reads), or None where the kernel does not take these inputs: not on
    the CPU, not all bfloat16 or all float32, a head size that is not a multiple of 64 up
    to 256, an empty batch, block or cache, an additive mask in another dtype, or no kernel
    on this CPU. Scores, softmax and the weighted sum run in float32, as
    ``small_block_attention`` runs them."""
    bs, heads, q, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if (
        query.device.type != "cpu"
        or query.dtype not in _KERNEL_DTYPES
        or not query.dtype == key.dtype == value.dtype
        or d % 64
        or d > 256
        or heads % kv_heads
        or min(bs, q, length) == 0
        or (mask is not None and mask.dtype not in (torch.bool, query.dtype))
    ):
        return None
    lib = _small_attention_library()
    if lib is None:
        return None
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    rows = None
    if mask is not None:
        rows = mask.expand(bs, 1, q, length)[:, 0]
        rows = rows.view(torch.uint8) if mask.dtype == torch.bool else rows
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
    kind = 0 if rows is None else 1 if mask.dtype == torch.bool else 2
    strides = (ctypes.c_long * 12)(
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *(rows.stride() if rows is not None else (0, 0, 0))
    )
    out = torch.empty(bs, q, heads, d, dtype=query.dtype)
    lib.graft_small_attention(
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        None if rows is None else rows.data_ptr(),
        kind,
        out.data_ptr(),
        bs,
        heads,
        kv_heads,
        q,
        length,
        d,
        strides,
        scale,
        int(query.dtype == torch.bfloat16),
    )
    return out


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    kernel: bool = False,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[bs, heads, q, d]`` query and
    ``[bs, kv_heads, L, d]`` key/value in, ``[bs, q, heads, d]`` out; with ``kernel``, small
    blocks try ``small_attention`` first."""
    q_len, kv_len = query.shape[2], key.shape[2]
    plain = query.device.type == "cpu" and kwargs.get("position_bias") is None and kwargs.get("cache") is None
    # Without a mask, causality comes from ``is_causal``, which SDPA aligns to the top-left
    # corner: right only when the block is the whole sequence (transformers slices then).
    if not plain or (attention_mask is None and 1 < q_len < kv_len):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if dropout == 0.0 and q_len <= SMALL_BLOCK and (attention_mask is not None or q_len == 1):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = small_attention(query, key, value, attention_mask, scale) if kernel else None
        if out is not None:
            return out, None
        return small_block_attention(query, key, value, attention_mask, scale).transpose(1, 2).contiguous(), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(attention_mask is None and q_len > 1 and causal),
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
AttentionInterface.register(GQA_KERNEL, functools.partial(gqa_sdpa_forward, kernel=True))
AttentionMaskInterface.register(GQA_KERNEL, sdpa_mask)


def use_gqa_attention(model: torch.nn.Module, kernel: bool = True) -> None:
    """Switch a loaded model from ``sdpa`` to ``gqa_sdpa_forward`` (other attention
    implementations, e.g. ``eager`` or flash kernels, are left as chosen); with ``kernel``,
    small query blocks take ``small_attention`` where it can run (it is then built here, so
    a build problem is logged before any decoding)."""
    if getattr(model.config, "_attn_implementation", None) in ("sdpa", GQA_SDPA, GQA_KERNEL):
        model.set_attn_implementation(GQA_KERNEL if kernel and small_attention_available() else GQA_SDPA)
