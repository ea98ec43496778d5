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

The models the CLI and the benchmark load all use it, transformers' baselines included
(they share the loaded target and draft), so every method measures the same attention.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The name under which ``gqa_sdpa_forward`` is registered with transformers.
GQA_SDPA = "graft_gqa_sdpa"
#: Query blocks up to this many tokens take ``small_block_attention`` on the CPU.
SMALL_BLOCK = 32


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


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[bs, heads, q, d]`` query and
    ``[bs, kv_heads, L, d]`` key/value in, ``[bs, q, heads, d]`` out."""
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


def use_gqa_attention(model: torch.nn.Module) -> None:
    """Switch a loaded model from ``sdpa`` to ``gqa_sdpa_forward`` (other attention
    implementations, e.g. ``eager`` or flash kernels, are left as chosen)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(GQA_SDPA)
