"""The CPU linear kernels (``engine.cpu_linear``: AVX2, and AVX512-BF16 for bf16 x bf16):
exact against float64, batch-invariant, and decoding through them stays lossless.

Skipped where the kernel cannot run (no AVX2/FMA, no C++ compiler): there ``auto`` never
selects it, so nothing else depends on it. The AVX512-BF16 path's tests skip on CPUs
without it; the AVX2 path's bf16 tests run everywhere (the faster path switched off).
"""

from __future__ import annotations

import copy as copy_module
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models
from sglang_graft.engine import cpu_linear as cpu_linear_module
from sglang_graft.engine.cpu_linear import (
    BF16_DOT_MAX_ROWS,
    BF16_DOT_NEEDS,
    KernelLinear,
    _bf16_dot_library,
    _library,
    _warn_fallback,
    build_library,
    cpu_flags,
    cpu_linear,
    cxx_compiler,
    pack_panels,
    panel_linear,
    unavailable_reason,
    use_cpu_kernel,
    wants_cpu_kernel,
)
from sglang_graft.engine.draft_head import DraftHead
from sglang_graft.engine.draft_int8 import int8_draft

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"CPU kernel: {unavailable_reason()}")

DTYPES = (torch.bfloat16, torch.float32)


def _error_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, ref: torch.Tensor, out_dtype) -> torch.Tensor:
    """Float32 accumulation error over K terms, plus one bf16 rounding of the output."""
    k = x.shape[-1]
    scale = x.double().abs() @ w.double().abs().t() + (0.0 if bias is None else bias.double().abs())
    bound = (k + 2) * 2.0**-23 * scale + 1e-30
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    return bound


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 14),
    n=st.integers(1, 37),
    k=st.integers(1, 70),
    w_dtype=st.sampled_from(DTYPES),
    x_dtype=st.sampled_from(DTYPES),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_and_rows_are_batch_invariant(m, n, k, w_dtype, x_dtype, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(w_dtype)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    bias = torch.randn(n, generator=gen).to(w_dtype) if with_bias else None
    out = cpu_linear(x, w, bias)
    assert out.dtype == x_dtype and out.shape == (m, n)
    ref = x.double() @ w.double().t() + (0.0 if bias is None else bias.double())
    assert bool(((out.double() - ref).abs() <= _error_bound(x, w, bias, ref, x_dtype)).all())
    # A row's outputs do not depend on which rows share the call (decode step vs tree verify).
    for i in range(m):
        assert torch.equal(cpu_linear(x[i : i + 1], w, bias)[0], out[i])
    assert torch.equal(cpu_linear(x.flip(0), w, bias), out.flip(0))


@pytest.fixture(params=["bf16-dot", "avx2"])
def bf16_path(request, monkeypatch):
    """Which path bf16 x bf16 products take: AVX512-BF16 (skipped where the CPU lacks it)
    or AVX2 (the faster path switched off)."""
    if request.param == "avx2":
        monkeypatch.setattr(cpu_linear_module, "_bf16_dot_library", lambda: None)
    else:
        _require_bf16_dot()
    return request.param


def _require_bf16_dot() -> None:
    """Skip where the CPU lacks AVX512-BF16; where it has it, the path must build."""
    if not BF16_DOT_NEEDS <= cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(sorted(BF16_DOT_NEEDS - cpu_flags()))}")
    assert _bf16_dot_library() is not None, "the AVX512-BF16 path failed to build (see the log)"


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11, 12, 13, BF16_DOT_MAX_ROWS])  # 2 x 8 and 4 x 6 blocks, partial ones;
# 5 to 12 rows: two or three passes in segments of 128 k
@pytest.mark.parametrize("k", [29, 96, 1543])  # a tail only; full steps only, under one segment; both, over 12 segments
def test_bf16_paths_match_float64_and_are_batch_invariant(bf16_path, m, k):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    w = torch.randn(45, k, generator=gen).bfloat16()  # 45: 8- and 6-row blocks with a remainder
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(45, generator=gen).bfloat16()
    out = cpu_linear(x, w, bias)
    ref = x.double() @ w.double().t() + bias.double()
    assert bool(((out.double() - ref).abs() <= _error_bound(x, w, bias, ref, torch.bfloat16)).all())
    for i in range(m):
        assert torch.equal(cpu_linear(x[i : i + 1], w, bias)[0], out[i])
    order = torch.randperm(m, generator=gen)
    assert torch.equal(cpu_linear(x[order], w, bias), out[order])


@pytest.mark.parametrize("m", [1, 2, 11, 12, 13, 24, 25, 100])  # register blocks of 1 to 12 rows, several blocks
@pytest.mark.parametrize("n,k", [(45, 29), (64, 1543), (32, 2)])  # a padded last panel, an odd K; full panels
def test_panel_path_matches_float64_and_is_batch_invariant(m, n, k):
    _require_bf16_dot()
    gen = torch.Generator().manual_seed(m * 1000 + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = pack_panels(w)
    out = panel_linear(x, packed, n, bias)
    ref = x.double() @ w.double().t() + bias.double()
    assert bool(((out.double() - ref).abs() <= _error_bound(x, w, bias, ref, torch.bfloat16)).all())
    for i in range(m):  # a decode step's row, a verify's and a prefill chunk's agree bit for bit
        assert torch.equal(panel_linear(x[i : i + 1], packed, n, bias)[0], out[i])
    order = torch.randperm(m, generator=gen)
    assert torch.equal(panel_linear(x[order], packed, n, None), panel_linear(x, packed, n, None)[order])


def test_bf16_layers_run_on_panels_packed_again_when_the_weight_changes():
    _require_bf16_dot()
    gen = torch.Generator().manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(40, 70)).bfloat16()
    use_cpu_kernel(model)
    layer = model[0]
    packed = layer.panels()
    assert packed is not None and layer.panels() is packed  # packed at load, once
    x = torch.randn(3, 40, generator=gen).bfloat16()
    with torch.inference_mode():
        assert torch.equal(layer(x), panel_linear(x, packed, 70, layer.bias))
        layer.weight.copy_(torch.randn(70, 40, generator=gen))  # loaded into: the panels are stale
        assert torch.equal(layer(x), panel_linear(x, pack_panels(layer.weight), 70, layer.bias))
    copy = copy_module.deepcopy(layer)
    assert copy._packed is None  # a copy packs its own weight when it first needs to
    with torch.inference_mode():
        copy.weight.mul_(2)
        assert torch.equal(layer(x), panel_linear(x, pack_panels(layer.weight), 70, layer.bias))
        assert torch.equal(copy(x), panel_linear(x, pack_panels(copy.weight), 70, copy.bias))
    assert layer.float()._packed is None and layer.panels() is None  # cast: panels dropped; float32 takes cpu_linear
    with torch.inference_mode():  # a model built under inference mode (no version counters) packs too
        made_there = torch.nn.Sequential(torch.nn.Linear(40, 70)).bfloat16()
        use_cpu_kernel(made_there)
        assert torch.equal(made_there(x), panel_linear(x, pack_panels(made_there[0].weight), 70, made_there[0].bias))


def test_panels_that_would_not_fit_in_memory_are_not_made(monkeypatch, caplog):
    _require_bf16_dot()
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64)).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    need = sum(_bf16_dot_library().graft_bf16_panel_bytes(n, k) for n, k in ((96, 64), (64, 96)))
    monkeypatch.setattr(cpu_linear_module, "available_memory", lambda: need)  # panels may take half of it
    with caplog.at_level(logging.INFO, logger="sglang_graft"):
        assert use_cpu_kernel(model) == 2
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "stay on their weights as loaded" in said and "more than 50% of the" in said
    assert all(layer.panels() is None and layer._packed is None for layer in model)
    with torch.inference_mode():
        expected = cpu_linear(cpu_linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias)
        assert torch.equal(model(x), expected)  # the row-major kernel, still batch-invariant
    roomy = torch.nn.Sequential(torch.nn.Linear(64, 96)).bfloat16()
    monkeypatch.setattr(cpu_linear_module, "available_memory", lambda: 2 * need)
    use_cpu_kernel(roomy)
    assert roomy[0]._packed is not None


def test_bf16_dot_path_leaves_long_calls_to_pytorch():
    _require_bf16_dot()
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(40, 96, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    x = torch.randn(BF16_DOT_MAX_ROWS + 1, 96, generator=gen).bfloat16()
    assert torch.equal(cpu_linear(x, w, bias), torch.nn.functional.linear(x, w, bias))  # a prefill: oneDNN's GEMM
    kernel = cpu_linear(x[:BF16_DOT_MAX_ROWS], w, bias)
    assert torch.equal(kernel[3], cpu_linear(x[3:4], w, bias)[0])  # up to the bound: the kernel's sums


def test_leading_dims_and_large_blocks():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(70, 300, generator=gen).bfloat16()
    x = torch.randn(2, 32, 300, generator=gen).bfloat16()  # 64 rows: the kernel on either path
    out = cpu_linear(x, w)
    assert out.shape == (2, 32, 70)
    assert torch.equal(out[1, 7], cpu_linear(x[1, 7], w))


def test_empty_shapes():
    bias = torch.randn(3)
    assert torch.equal(cpu_linear(torch.randn(2, 0), torch.randn(3, 0), bias), bias.expand(2, 3))
    assert cpu_linear(torch.randn(0, 5), torch.randn(3, 5)).shape == (0, 3)
    assert cpu_linear(torch.randn(2, 5), torch.randn(0, 5)).shape == (2, 0)


def test_bad_inputs_name_the_problem():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="float16"):
        cpu_linear(torch.randn(2, 8), w.half())
    with pytest.raises(ValueError, match="contiguous: False"):
        cpu_linear(torch.randn(2, 4), w.t())
    with pytest.raises(ValueError, match="input has 5 features, the weight expects 8"):
        cpu_linear(torch.randn(2, 5), w)
    with pytest.raises(ValueError, match="activations"):
        cpu_linear(torch.randn(2, 8, dtype=torch.float64), w)


def test_mode_resolution():
    with pytest.raises(ValueError, match="one of"):
        wants_cpu_kernel("yes", torch.float32, "cpu")
    with pytest.raises(ValueError, match="'cuda'"):
        wants_cpu_kernel("on", torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="float16"):
        wants_cpu_kernel("on", torch.float16, "cpu")
    assert not wants_cpu_kernel("off", torch.float32, "cpu")
    assert not wants_cpu_kernel("auto", torch.float16, "cpu")
    assert not wants_cpu_kernel("auto", torch.float32, "cuda")
    assert wants_cpu_kernel("auto", torch.float32, "cpu")
    assert wants_cpu_kernel("on", torch.bfloat16, "cpu")


@pytest.mark.parametrize(
    ("flags", "chosen"),
    [({"avx2", "fma"}, True), ({"avx2", "fma", "avx512_bf16"}, True), ({"avx2", "fma", "avx512_bf16", "amx_bf16"}, False)],
)
def test_auto_leaves_bf16_to_pytorch_on_amx_cpus_only(monkeypatch, flags, chosen):
    monkeypatch.setattr(cpu_linear_module, "cpu_flags", lambda: frozenset(flags))
    assert wants_cpu_kernel("auto", torch.bfloat16, "cpu") is chosen
    assert wants_cpu_kernel("auto", torch.float32, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_model_matches_pytorch_and_shares_weights(dtype):
    target, _ = tiny_models("qwen2", vocab_size=200, seed=3, hidden=32, dtype=dtype)
    reference, _ = tiny_models("qwen2", vocab_size=200, seed=3, hidden=32, dtype=dtype)
    weights = {name: p for name, p in target.named_parameters()}
    linears = sum(type(m) is torch.nn.Linear for m in target.modules())
    assert use_cpu_kernel(target) == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in target.modules())
    assert {name: p for name, p in target.named_parameters()} == weights  # no copies
    ids = torch.tensor([[5, 17, 99, 3, 42, 8]])
    with torch.inference_mode():
        ours, theirs = target(ids).logits.double(), reference(ids).logits.double()
    tol = 1e-4 if dtype == torch.float32 else 0.1 * float(theirs.abs().max())
    assert float((ours - theirs).abs().max()) < tol


def test_a_failed_build_falls_back_under_auto_and_is_named_under_on(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SGLANG_GRAFT_CACHE", str(blocker / "cache"))  # mkdir under a file fails
    _library.cache_clear()
    _warn_fallback.cache_clear()
    try:
        assert "building it failed" in unavailable_reason()
        with caplog.at_level(logging.WARNING, logger="sglang_graft"):
            assert not wants_cpu_kernel("auto", torch.float32, "cpu")
            assert not wants_cpu_kernel("auto", torch.bfloat16, "cpu")
        said = [r.getMessage() for r in caplog.records if "PyTorch's own linear layers run instead" in r.getMessage()]
        assert len(said) == 1 and "building it failed" in said[0], "the fallback is said once, with its reason"
        with pytest.raises(ValueError, match="--cpu-kernel on: building it failed"):
            wants_cpu_kernel("on", torch.float32, "cpu")
    finally:
        _library.cache_clear()



@pytest.mark.skipif(cxx_compiler() is None, reason="no C++ compiler (g++) here")
def test_a_library_of_several_sources_is_rebuilt_when_any_of_them_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_GRAFT_CACHE", str(tmp_path / "cache"))
    main, extra = tmp_path / "main.cpp", tmp_path / "extra.cpp"
    main.write_text('extern "C" int f();\nextern "C" int g() { return f() + 1; }\n')
    extra.write_text('extern "C" int f() { return 41; }\n')
    flags = ("-O1", "-shared", "-fPIC")
    assert build_library(main, flags, "test library", (extra,)).g() == 42
    extra.write_text('extern "C" int f() { return 1; }\n')
    assert build_library(main, flags, "test library", (extra,)).g() == 2
    assert len(list((tmp_path / "cache" / "kernels").glob("main-*.so"))) == 2

PROMPTS = [[11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15, 16, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6], [42, 7]]


@pytest.fixture(scope="module")
def kernel_pair():
    torch.set_num_threads(1)
    target, draft = tiny_models("llama", vocab_size=200, seed=1, hidden=32)
    use_cpu_kernel(target)
    use_cpu_kernel(draft)
    ref = [SpecEngine(target, None, EngineConfig(policy="ar")).generate([p], 16).requests[0].token_ids for p in PROMPTS]
    return target, draft, ref


@pytest.mark.parametrize("policy", ["dense", "pruned", "retrieval", "graft"])
def test_policies_through_the_kernel_equal_ar(kernel_pair, policy):
    target, draft, ref = kernel_pair
    engine = SpecEngine(target, draft, EngineConfig(policy=policy, num_nodes=6, draft_depth=3, draft_topk=3))
    batch = engine.generate(PROMPTS, 16)
    assert [r.token_ids for r in batch.requests] == ref
    assert sum(sum(r.accepted.values()) for r in batch.requests) > 0, "nothing accepted: the test would prove nothing"


def test_int8_draft_and_draft_head_keep_the_kernel(kernel_pair):
    target, draft, ref = kernel_pair
    q = int8_draft(draft, "fbgemm")  # the same module kinds on every host
    head = q.get_output_embeddings()
    assert type(head) is KernelLinear and head.weight is draft.get_output_embeddings().weight
    assert type(q.model.layers[0].mlp.down_proj) is KernelLinear
    assert isinstance(q.model.layers[0].mlp.up_proj, torch.ao.nn.quantized.dynamic.Linear)
    assert type(draft.model.layers[0].mlp.up_proj) is KernelLinear  # the loaded draft is left as it was
    dh = DraftHead(q, 50, PROMPTS, 200)
    hidden = torch.randn(2, 3, 32)
    logits = dh(hidden)
    expected = torch.nn.functional.linear(hidden, head.weight.float())
    kept = dh.ids
    assert logits.shape[-1] == len(kept)  # the kept columns only
    assert torch.allclose(logits, expected[..., kept], atol=1e-4)
    assert 60 not in kept.tolist() and int(dh.columns[60]) == -1
    config = EngineConfig(policy="graft", num_nodes=6, draft_depth=3, draft_topk=3, draft_int8=True, draft_vocab=50)
    batch = SpecEngine(target, draft, config).generate(PROMPTS, 16)
    assert [r.token_ids for r in batch.requests] == ref
