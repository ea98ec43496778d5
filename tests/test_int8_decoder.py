"""The int8 draft's fused decoder layers (``engine/int8_decoder.py``): the same forward as
the layers they replace, on a cache with tree masks, positions and padding as the engine
passes them; only the layers they compute are fused; and an engine drafting with them (and
a head over part of the vocabulary) is lossless. The tests skip on CPUs without the int8
kernels."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from sglang_graft.engine import tiny_models
from sglang_graft.engine.draft_int8 import int8_draft, reads_spans
from sglang_graft.engine.int8_decoder import PROJECTIONS, FusedInt8Layer, fusable, fuse_int8_layers
from sglang_graft.engine.int8_linear import Int8Linear

from helpers import EACH_INT8_KERNEL, assert_int8_draft_lossless


def all_int8(model: torch.nn.Module, kernel: str) -> torch.nn.Module:
    """``int8_draft`` of a float32 model, with the ``down_proj`` it keeps in float32 (such a
    draft reads its prompts itself) on the kernel too, so every layer is fusable."""
    q = int8_draft(model, kernel)
    for layer in q.model.layers:
        layer.mlp.down_proj = Int8Linear.from_linear(layer.mlp.down_proj, kernel)
    return q


def additive(allowed: torch.Tensor) -> torch.Tensor:
    """The engine's mask (``engine.kv``): 0 where a query sees a key, the dtype's lowest elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    return mask.masked_fill_(~allowed, torch.finfo(torch.float32).min).unsqueeze(1)


def forward_twice(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of a left-padded 7-token prefill over two rows, then of a 4-token tree
    block (two branches) after it."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 120, (2, 7), generator=gen)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :2] = False  # the second row is two tokens shorter
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache()
    with torch.inference_mode():
        first = model.model(
            prompt, attention_mask=additive(causal & valid[:, None, :]), position_ids=positions, past_key_values=cache
        ).last_hidden_state
        block = torch.randint(0, 120, (2, 4), generator=gen)
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        allowed = torch.cat([valid[:, None, :].expand(2, 4, 7), tree.expand(2, 4, 4)], dim=2)
        depth = torch.tensor([0, 1, 1, 2])
        second = model.model(
            block,
            attention_mask=additive(allowed),
            position_ids=positions[:, -1:] + 1 + depth,
            past_key_values=cache,
        ).last_hidden_state
    return first, second


@EACH_INT8_KERNEL
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_layers_compute_the_layers_they_replace(kernel, arch):
    _, draft = tiny_models(arch, vocab_size=120, seed=4, hidden=64, layers=3)
    plain = all_int8(draft, kernel)
    fused = copy.deepcopy(plain)
    assert fuse_int8_layers(fused) == 3
    assert all(isinstance(layer, FusedInt8Layer) for layer in fused.model.layers)
    for ours, theirs in zip(forward_twice(fused), forward_twice(plain)):
        # Equal up to rounding: RMSNorm's sums and SiLU's exp run in another order, and a
        # one-quantum flip in an int8 activation moves an output by ~1e-3 of its range.
        # A wrong rotation, layout, mask or residual moves it by its own size.
        tol = 2e-3 * float(theirs.abs().max())
        assert torch.allclose(ours, theirs, rtol=0, atol=tol), float((ours - theirs).abs().max())
    # A copy of a fused model runs on its own weights (the kernel's pointers are rebuilt).
    twin = copy.deepcopy(fused)
    fused.model.layers[0].layer.input_layernorm.weight.data.mul_(3.0)
    assert torch.equal(forward_twice(twin)[1], forward_twice(copy.deepcopy(twin))[1])
    assert not torch.equal(forward_twice(twin)[0], forward_twice(fused)[0])


@EACH_INT8_KERNEL
def test_int8_draft_fuses_a_bf16_draft_that_reads_its_own_prompts(kernel):
    _, draft = tiny_models("qwen2", vocab_size=120, seed=2, hidden=64, dtype=torch.bfloat16)
    if not reads_spans(draft):
        pytest.skip("this CPU does not multiply bf16 natively, so the int8 draft keeps down_proj as loaded")
    q = int8_draft(draft, kernel)
    assert all(isinstance(layer, FusedInt8Layer) for layer in q.model.layers)
    assert not any(isinstance(m, FusedInt8Layer) for m in draft.modules())  # the loaded draft is left alone


@EACH_INT8_KERNEL
def test_only_layers_it_computes_are_fused(kernel):
    _, qwen2 = tiny_models("qwen2", vocab_size=120, seed=4, hidden=64)
    partly = int8_draft(qwen2, kernel)  # float32: down_proj stays float32
    assert not isinstance(partly.model.layers[0].mlp.down_proj, Int8Linear)
    assert not any(isinstance(m, FusedInt8Layer) for m in partly.modules())
    with pytest.raises(ValueError, match="Qwen2DecoderLayer is not a fusable int8 decoder layer"):
        FusedInt8Layer(partly.model.layers[0])
    _, qwen3 = tiny_models("qwen3", vocab_size=120, seed=4, hidden=64)
    q3 = all_int8(qwen3, kernel)
    q3.config.hidden_act = "gelu"  # the layers share the model's config
    assert not fusable(q3.model.layers[0]) and fuse_int8_layers(q3) == 0
    q3.config.hidden_act = "silu"
    q3.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3  # its norms no longer share one epsilon
    assert fusable(q3.model.layers[0]) and not fusable(q3.model.layers[1])
    assert fuse_int8_layers(q3) == 1
    assert set(PROJECTIONS) == {"q", "k", "v", "o", "gate", "up", "down"}

@EACH_INT8_KERNEL
@pytest.mark.parametrize(("arch", "policy"), [("qwen2", "dense"), ("qwen2", "graft"), ("qwen3", "graft")])
def test_drafting_with_fused_layers_is_lossless(kernel, arch, policy):
    target, draft = tiny_models(arch, vocab_size=120, seed=2, hidden=64)
    fused = all_int8(draft, kernel)
    assert fuse_int8_layers(fused) == 2
    assert assert_int8_draft_lossless(target, fused, policy, kernel, draft_vocab=64).draft is fused

