"""``engine.attention``: masked grouped-query attention without repeated KV heads computes
what transformers' ``sdpa`` does, and the models the engine loads use it."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_graft.engine.attention import (
    GQA_KERNEL,
    GQA_SDPA,
    small_attention_available,
    small_block_attention,
    use_gqa_attention,
)
from sglang_graft.engine.models import TINY_ARCHS, prepare_pair, tiny_models


def _with_sdpa(model: torch.nn.Module) -> torch.nn.Module:
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("sdpa")
    return plain


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_logits_match_sdpa_with_and_without_masks(arch: str) -> None:
    target, _ = tiny_models(arch, dtype=torch.float64)
    assert target.config._attn_implementation in (GQA_SDPA, GQA_KERNEL)
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    plain = _with_sdpa(target)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 257, (2, 12), generator=gen)
    # A tree-like 4D mask: causal, row 1 left-padded by 3 columns, one column hidden.
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    mask[1, :, :, :3] = False
    mask[:, :, 8:, 6] = False
    mask |= torch.eye(12, dtype=torch.bool)
    with torch.inference_mode():
        torch.testing.assert_close(target(x).logits, plain(x).logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(
            target(x, attention_mask=mask).logits, plain(x, attention_mask=mask).logits, rtol=0, atol=1e-12
        )
        # A cached multi-token step (no mask given: transformers builds the causal one).
        cache_a = target(x[:, :7], use_cache=True).past_key_values
        cache_b = plain(x[:, :7], use_cache=True).past_key_values
        torch.testing.assert_close(
            target(x[:, 7:], past_key_values=cache_a).logits, plain(x[:, 7:], past_key_values=cache_b).logits, rtol=0, atol=1e-12
        )


def test_transformers_generation_unchanged() -> None:
    target, _ = tiny_models("qwen2", dtype=torch.float32)
    plain = _with_sdpa(target)
    prompt = torch.randint(0, 257, (1, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(target.generate(prompt, **kw), plain.generate(prompt, **kw))


def test_loaded_pair_uses_it_and_other_implementations_stay() -> None:
    pair = prepare_pair("tiny", "tiny")
    want = GQA_KERNEL if small_attention_available() else GQA_SDPA
    assert pair.target.config._attn_implementation == want
    assert pair.draft.config._attn_implementation == want
    # --cpu-kernel off keeps PyTorch's ops.
    pair = prepare_pair("tiny", "tiny", cpu_kernel="off")
    assert pair.target.config._attn_implementation == GQA_SDPA
    assert pair.draft.config._attn_implementation == GQA_SDPA
    target, _ = tiny_models("llama")
    target.set_attn_implementation("eager")
    use_gqa_attention(target)
    assert target.config._attn_implementation == "eager"


# Without a mask only one-token blocks take the small path (a longer one needs causality).
@pytest.mark.parametrize(
    "q, mask_kind", [(1, "none"), *((q, kind) for q in (1, 5, 32) for kind in ("bool", "additive"))]
)
def test_small_block_attention_matches_sdpa(q: int, mask_kind: str) -> None:
    gen = torch.Generator().manual_seed(q)
    bs, heads, kv_heads, cached, d = 2, 6, 2, 40, 16
    query = torch.randn(bs, heads, q, d, dtype=torch.float64, generator=gen)
    key, value = (torch.randn(bs, kv_heads, cached + q, d, dtype=torch.float64, generator=gen) for _ in range(2))
    allowed = torch.rand(bs, 1, q, cached + q, generator=gen) < 0.7
    allowed[..., cached:] |= torch.eye(q, dtype=torch.bool)  # every query sees itself
    mask = {
        "none": None,
        "bool": allowed,
        "additive": torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min),
    }[mask_kind]
    got = small_block_attention(query, key, value, mask, d**-0.5)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # bf16 inputs come back in bf16, computed in float32.
    got16 = small_block_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), allowed, d**-0.5)
    assert got16.dtype == torch.bfloat16
    want32 = torch.nn.functional.scaled_dot_product_attention(
        query.bfloat16().float(), key.bfloat16().float(), value.bfloat16().float(), attn_mask=allowed, enable_gqa=True
    )
    torch.testing.assert_close(got16.float(), want32, rtol=0, atol=1e-2)


def test_small_block_attention_keeps_a_row_with_nothing_to_attend_finite() -> None:
    query, key, value = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    out = small_block_attention(query, key, value, torch.zeros(1, 1, 1, 3, dtype=torch.bool), 0.5)
    assert torch.isfinite(out).all()
