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
