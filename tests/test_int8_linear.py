"""The int8 kernels (``engine/int8_linear.py``, AMX and AVX512-VNNI): exactly the arithmetic
they document, refused where they cannot run, and lossless inside the int8 draft. Each
kernel's tests skip on CPUs without it; the choice and refusal tests run everywhere."""

from __future__ import annotations

import pytest
import torch

from sglang_graft.engine import EngineConfig, tiny_models
from sglang_graft.engine import draft_int8 as draft_int8_module
from sglang_graft.engine import int8_linear
from sglang_graft.engine.draft_int8 import int8_draft, int8_kernel, resolve_int8_kernel
from sglang_graft.engine.int8_linear import Int8Linear, fits, quantize_weight
from sglang_graft.engine.models import weight_cost_ratio

from helpers import EACH_INT8_KERNEL, assert_int8_draft_lossless


def reference(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """The kernel's arithmetic, with exact integer sums: each row of ``x`` quantized to int8
    with its own scale (``x * (127 / max|x|)`` rounded half to even, as AVX512 converts),
    times the per-channel int8 weights, rescaled, plus the bias."""
    q, w_scale = quantize_weight(linear.weight)
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(x * inv).clamp(-127, 127)
    sums = xq.double() @ q.double().T
    out = sums * (amax.double() / 127.0) * w_scale.double()
    return out + (0.0 if linear.bias is None else linear.bias.double())


@EACH_INT8_KERNEL
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 16, 17, 32, 40])
@pytest.mark.parametrize(
    ("out_features", "in_features", "bias"),
    [(32, 64, True), (96, 192, False), (64, 128, True), (32, 4864, False)],  # 4864: the 0.5B draft's down_proj
)
def test_kernel_computes_its_documented_arithmetic(kernel, rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen) * 4
    x[0, 3] = 40.0  # an outlier in one row: per-row scales keep it from clipping the others
    with torch.no_grad():
        got = Int8Linear.from_linear(linear, kernel)(x)
        exact = linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), reference(x, linear), rtol=1e-5, atol=1e-4)
    # and close to the float layer it stands for
    assert float((got - exact).norm() / exact.norm()) < 0.03


@EACH_INT8_KERNEL
def test_leading_dimensions_and_a_zero_row(kernel):
    linear = torch.nn.Linear(64, 32)
    layer = Int8Linear.from_linear(linear, kernel)
    x = torch.randn(2, 3, 64)
    x[1, 2] = 0.0
    with torch.no_grad():
        got = layer(x)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got.reshape(6, 32).double(), reference(x.reshape(6, 64), linear), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1, 2], linear.bias.detach())  # an all-zero row gives the bias


def test_shapes_and_inputs_it_does_not_take_are_refused_by_name():
    assert fits(torch.nn.Linear(64, 32)) and not fits(torch.nn.Linear(32, 32))
    assert not fits(torch.nn.Linear(64, 48))
    with pytest.raises(ValueError, match=r"in_features % 64 == 0, got 32 x 60"):
        Int8Linear.from_linear(torch.nn.Linear(60, 32), "vnni")
    packed, scale = torch.zeros(32, 64, dtype=torch.int8), torch.ones(32)
    with pytest.raises(ValueError, match="int8 kernel must be one of amx, vnni, got 'avx2'"):
        Int8Linear("avx2", packed, scale, None, None)
    with pytest.raises(ValueError, match="the vnni kernel needs a weight-sum correction"):
        Int8Linear("vnni", packed, scale, None, None)
    layer = Int8Linear("amx", packed, scale, None, None)  # no kernel call needed
    with pytest.raises(ValueError, match="float32 CPU inputs with 64 features, got torch.bfloat16"):
        layer(torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="with 64 features, got torch.float32 on cpu with 32"):
        layer(torch.zeros(1, 32))


def test_kernel_choice_falls_back_or_refuses_by_name(monkeypatch):
    with pytest.raises(ValueError, match="--int8-kernel must be one of auto, amx, vnni, fbgemm, got 'avx2'"):
        resolve_int8_kernel("avx2")
    with pytest.raises(ValueError, match="draft_int8_kernel must be one of"):
        EngineConfig(policy="graft", draft_int8=True, draft_int8_kernel="avx2")
    assert resolve_int8_kernel("fbgemm") == "fbgemm"
    missing = {"amx": "this CPU lacks amx_int8", "vnni": "this CPU lacks avx512_vnni"}
    monkeypatch.setattr(int8_linear, "unavailable_reason", lambda k: missing.get(k))
    monkeypatch.setattr(draft_int8_module, "unavailable_reason", lambda k: missing.get(k))
    assert resolve_int8_kernel("auto") == "fbgemm"
    with pytest.raises(ValueError, match="--int8-kernel amx: this CPU lacks amx_int8; use --int8-kernel fbgemm or auto"):
        resolve_int8_kernel("amx")
    with pytest.raises(ValueError, match="--int8-kernel vnni: this CPU lacks avx512_vnni; use --int8-kernel fbgemm"):
        resolve_int8_kernel("vnni")
    _, draft = tiny_models("qwen2", vocab_size=120, seed=2, hidden=64)
    q = int8_draft(draft)  # auto, with neither kernel available
    assert int8_kernel(q) == "fbgemm" and not any(isinstance(m, Int8Linear) for m in q.modules())
    missing.pop("vnni")  # a VNNI host without AMX: auto takes vnni
    assert resolve_int8_kernel("auto") == "vnni"


@EACH_INT8_KERNEL
@pytest.mark.parametrize("policy", ["dense", "graft"])
def test_an_int8_draft_on_the_kernel_is_lossless(kernel, policy):
    target, draft = tiny_models("qwen2", vocab_size=120, seed=2, hidden=64)
    q = int8_draft(draft, kernel)
    assert int8_kernel(q) == kernel and int8_kernel(draft) is None
    ours = [n for n, m in q.named_modules() if isinstance(m, Int8Linear) and m.kernel == kernel]
    assert any(n.endswith("self_attn.q_proj") for n in ours) and any(n.endswith("mlp.up_proj") for n in ours)
    assert type(q.get_output_embeddings()) is not Int8Linear  # the head stays sliceable for DraftHead
    assert weight_cost_ratio(q, target) < weight_cost_ratio(draft, target)  # one byte per int8 weight
    engine = assert_int8_draft_lossless(target, draft, policy, kernel)
    assert int8_kernel(engine.draft) == kernel
