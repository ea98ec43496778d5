"""``engine.attention.small_attention``: the AVX512 kernel for small query blocks computes
``small_block_attention`` (checked against float64), gives each query the same bits
whichever queries share the call, and keeps every policy lossless."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.engine import EngineConfig, SpecEngine, attention, tiny_models
from sglang_graft.engine.attention import (
    GQA_KERNEL,
    GQA_SDPA,
    SMALL_ATTENTION_NEEDS,
    SMALL_ATTENTION_PAIRS_FLAG,
    small_attention,
    small_attention_available,
    small_block_attention,
    use_gqa_attention,
)
from sglang_graft.engine.cpu_linear import cpu_flags, use_cpu_kernel
from sglang_graft.engine.cpu_linear import unavailable_reason as cpu_linear_unavailable
from sglang_graft.engine.kv import PaddedKV, left_pad

pytestmark = pytest.mark.skipif(
    not small_attention_available(),
    reason=f"small-block attention kernel: needs {', '.join(sorted(SMALL_ATTENTION_NEEDS))} "
    f"(missing {', '.join(sorted(SMALL_ATTENTION_NEEDS - cpu_flags())) or 'none'}) and a C++ compiler",
)


# The kernel's two builds: bf16 scores from widened floats, or (on CPUs with AVX512-BF16,
# where the engine picks it) from VDPBF16PS on bf16 pairs. The kernel-level claims hold for both.
BUILDS = [
    pytest.param(False, id="widened"),
    pytest.param(
        True,
        id="pairs",
        marks=pytest.mark.skipif(
            SMALL_ATTENTION_PAIRS_FLAG not in cpu_flags(), reason=f"the CPU lacks {SMALL_ATTENTION_PAIRS_FLAG}"
        ),
    ),
]


@contextlib.contextmanager
def _build(pairs: bool):
    """``small_attention`` through the build with or without bf16 pairs."""
    lib = attention._small_attention_library(pairs)
    # The module runs only where the engine's own build works; the other build must too.
    assert lib is not None, f"the small-attention kernel did not build with pairs={pairs}"
    with mock.patch.object(attention, "_small_attention_library", lambda: lib):
        yield


# The bitwise claims below need the linear layers on the project's fixed-order kernels too.
needs_linear_kernel = pytest.mark.skipif(
    cpu_linear_unavailable() is not None, reason=f"CPU linear kernel: {cpu_linear_unavailable()}"
)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The engine's form of a mask: 0 where it attends, the dtype's lowest elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def _inputs(bs, heads, kv_heads, q, length, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # The query as transformers hands it over: a transposed view of [bs, q, heads, d].
    query = torch.randn(bs, q, heads, d, generator=gen).to(dtype).transpose(1, 2)
    key = (2 * torch.randn(bs, kv_heads, length, d, generator=gen)).to(dtype)
    value = torch.randn(bs, kv_heads, length, d, generator=gen).to(dtype)
    mask = torch.rand(bs, 1, q, length, generator=gen) < 0.7
    mask[0, 0, 0] = False  # a row with nothing to attend: uniform, as PyTorch's softmax gives
    return query, key, value, mask


def _assert_as_accurate_as_ops(got, query, key, value, mask, scale) -> None:
    """Against a float64 reference, ``got`` errs no more than PyTorch's float32 ops do
    (``small_block_attention`` in the inputs' dtype), within float32 rounding."""
    want = small_block_attention(query.double(), key.double(), value.double(), mask, scale).transpose(1, 2)
    ops = small_block_attention(query, key, value, mask, scale).transpose(1, 2)
    err, ops_err = ((x.double() - want).abs().max().item() for x in (got, ops))
    assert err <= 2 * ops_err + 1e-6, f"kernel error {err:.3g}, PyTorch's ops {ops_err:.3g}"


@pytest.mark.parametrize("pairs", BUILDS)
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d", [(12, 2, 128), (14, 2, 64), (4, 4, 64), (2, 1, 256)])
@pytest.mark.parametrize("q, length", [(1, 1), (1, 700), (3, 17), (8, 64), (13, 130), (32, 300)])
def test_as_accurate_as_pytorch_ops(dtype, heads, kv_heads, d, q, length, additive, pairs) -> None:
    """A bool mask and the engine's additive one alike."""
    query, key, value, mask = _inputs(2, heads, kv_heads, q, length, d, dtype, seed=q * 1000 + length)
    with _build(pairs):
        got = small_attention(query, key, value, _additive(mask, dtype) if additive else mask, d**-0.5)
    assert got is not None and got.dtype == dtype and got.shape == (2, q, heads, d)
    _assert_as_accurate_as_ops(got, query, key, value, mask, d**-0.5)
    # The row with nothing to attend averages every value of its KV head.
    mean = value[0, 0].double().mean(dim=0)
    torch.testing.assert_close(got[0, 0, 0].double(), mean, rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("pairs", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_broadcast_mask_strided_cache_and_no_mask(dtype, pairs) -> None:
    query, key, value, mask = _inputs(3, 12, 2, 5, 90, 128, dtype, seed=7)
    # A cache slice (not contiguous over its keys, as a GrowingCache hands them over) and a
    # mask shared by the batch rows.
    key_view, value_view = key[:, :, 10:], value[:, :, 10:]
    shared = mask[:1, :, :, 10:]
    one = query[:, :, :1]
    with _build(pairs):
        got = small_attention(query, key_view, value_view, shared, 0.1)
        unmasked = small_attention(one, key, value, None, 0.1)
    _assert_as_accurate_as_ops(got, query, key_view, value_view, shared, 0.1)
    _assert_as_accurate_as_ops(unmasked, one, key, value, None, 0.1)


def test_inputs_it_does_not_take_come_back_none() -> None:
    query, key, value, mask = _inputs(1, 4, 2, 2, 10, 64, torch.float32, seed=0)
    # An additive mask in another dtype: float32's lowest would round to -inf in bf16.
    assert small_attention(query, key, value, _additive(mask, torch.bfloat16), 0.1) is None
    assert small_attention(query.double(), key.double(), value.double(), mask, 0.1) is None
    assert small_attention(query, key.bfloat16(), value, mask, 0.1) is None
    narrow = _inputs(1, 4, 2, 2, 10, 16, torch.float32, seed=0)
    assert small_attention(*narrow, 0.25) is None
    assert small_attention(query[:0], key[:0], value[:0], mask[:0], 0.1) is None


@pytest.mark.parametrize("pairs", BUILDS)
@settings(max_examples=30, deadline=None)
@given(
    q=st.integers(2, 12),
    length=st.integers(1, 200),
    row=st.integers(0, 11),
    seen=st.floats(0.05, 1.0),
    bf16=st.booleans(),
)
def test_a_query_gets_the_same_bits_alone_or_in_a_block(pairs, q, length, row, seen, bf16) -> None:
    """A decode step and a tree verify compute a token's attention alike: the other queries
    of the block, and keys the token does not see wherever they sit (a tree's other
    branches, padding), change no bit of its output."""
    row = row % q
    dtype = torch.bfloat16 if bf16 else torch.float32
    query, key, value, mask = _inputs(1, 12, 2, q, length, 128, dtype, seed=q * 997 + length)
    gen = torch.Generator().manual_seed(length)
    sees = torch.rand(length, generator=gen) < seen
    sees[-1] = True  # the token itself
    mask[:, :, row] = sees
    idx = sees.nonzero().squeeze(1)
    with _build(pairs):
        block = small_attention(query, key, value, _additive(mask, dtype), 0.125)  # as the engine passes it
        alone = small_attention(query[:, :, row : row + 1], key[:, :, idx], value[:, :, idx], None, 0.125)
    assert torch.equal(block[:, row : row + 1], alone)


@pytest.fixture(scope="module")
def wide_pair():
    """Tiny float32 models with 64-wide heads, the narrowest the kernel takes."""
    torch.set_num_threads(1)
    target, draft = tiny_models("qwen2", vocab_size=200, seed=3, hidden=256)
    assert target.config._attn_implementation == GQA_KERNEL
    return target, draft


def test_model_logits_match_pytorch_ops(wide_pair) -> None:
    target, _ = wide_pair
    plain = copy.deepcopy(target)
    use_gqa_attention(plain, kernel=False)
    assert plain.config._attn_implementation == GQA_SDPA
    x = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    mask[1, :, :, :3] = False
    mask |= torch.eye(12, dtype=torch.bool)
    with torch.inference_mode():
        for m in (mask, _additive(mask, torch.float32)):
            got, want = (model(x, attention_mask=m).logits for model in (target, plain))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("policy", ["dense", "pruned", "retrieval", "graft"])
def test_policies_equal_ar_through_the_kernel(wide_pair, policy) -> None:
    target, draft = wide_pair
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18] * 3, [3, 1, 4, 1, 5, 9, 2, 6]]
    ar = SpecEngine(target, None, EngineConfig(policy="ar")).generate(prompts, 24).requests
    plain = target.generate(torch.tensor([prompts[0]]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert plain[0, len(prompts[0]) :].tolist() == ar[0].token_ids
    engine = SpecEngine(target, draft, EngineConfig(policy=policy, num_nodes=8, draft_depth=3, draft_topk=3))
    runs = [engine.generate(prompts, 24).requests for _ in range(2)]  # the second run has history
    for out in runs:
        assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    accepted = sum(sum(r.accepted.values()) for out in runs for r in out)
    assert accepted > 0, f"{policy} accepted nothing: the test would prove nothing"


def _decode_and_verify_logits(model: torch.nn.Module, prompt: list[int], chain: int) -> tuple[list, list]:
    """Logits of ``chain`` one-token decode steps after ``prompt``, and of the same tokens
    as one branch of a tree verify (with a sibling beside each), over identical caches."""
    tokens, valid = left_pad([prompt[:-1]], 0, "cpu")

    def prefilled() -> PaddedKV:
        kv = PaddedKV(1, "cpu")
        kv.prefill(model, tokens, valid)
        return kv

    kv, seq, decoded = prefilled(), [prompt[-1]], []
    for _ in range(chain):
        step = torch.tensor([[seq[-1]]])
        logits = kv.forward(model, step, kv.lengths.unsqueeze(1), torch.zeros(1, 1, 1, dtype=torch.bool))
        kv.valid[:, -1] = True
        kv.lengths = kv.lengths + 1
        decoded.append(logits[0, -1])
        seq.append(int(logits[0, -1].argmax()))
    # The tree: the root, then per level a sibling (never on the path) and the path token.
    nodes, parents, depths, path = [seq[0]], [-1], [0], [0]
    for depth in range(1, chain):
        for token in ((seq[depth] + 1) % 200, seq[depth]):
            nodes.append(token)
            parents.append(path[-1])
            depths.append(depth)
        path.append(len(nodes) - 1)
    n = len(nodes)
    ancestors = torch.zeros(1, n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            ancestors[0, i, j] = True
            j = parents[j]
    kv = prefilled()
    logits = kv.forward(model, torch.tensor([nodes]), kv.lengths.unsqueeze(1) + torch.tensor([depths]), ancestors)
    return decoded, [logits[0, i] for i in path]


@needs_linear_kernel
def test_bf16_tree_verify_gives_a_token_its_decode_step_bits() -> None:
    """With the project's linear kernels and this one, a bf16 tree verify computes each path
    token's logits bitwise as plain decoding does: greedy speculation cannot flip a near-tie."""
    target, _ = tiny_models("qwen2", vocab_size=200, seed=5, hidden=256, dtype=torch.bfloat16)
    assert target.config._attn_implementation == GQA_KERNEL
    use_cpu_kernel(target)
    # Long prompts: over 700 cached tokens PyTorch's ops already differ at some depths.
    for seed in range(3):
        prompt = torch.randint(0, 200, (700,), generator=torch.Generator().manual_seed(seed)).tolist()
        with torch.inference_mode():
            decoded, verified = _decode_and_verify_logits(target, prompt, chain=4)
        for depth, (a, b) in enumerate(zip(decoded, verified)):
            assert torch.equal(a, b), f"prompt {seed}, depth {depth}: verify logits differ from the decode step's"


@needs_linear_kernel
@pytest.mark.parametrize("policy", ["dense", "graft"])
def test_bf16_policies_equal_ar_token_for_token(policy) -> None:
    """bf16 through both kernels: no near-tie can flip, so speculation equals plain decoding
    exactly, a batch with left padding included."""
    target, draft = tiny_models("qwen2", vocab_size=200, seed=6, hidden=256, dtype=torch.bfloat16)
    for model in (target, draft):
        use_cpu_kernel(model)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (500, 320)]
    ar = SpecEngine(target, None, EngineConfig(policy="ar")).generate(prompts, 24).requests
    engine = SpecEngine(target, draft, EngineConfig(policy=policy, num_nodes=8, draft_depth=3, draft_topk=3))
    out = engine.generate(prompts, 24).requests
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert sum(sum(r.accepted.values()) for r in out) > 0, f"{policy} accepted nothing: the test would prove nothing"


@pytest.mark.parametrize("pairs", BUILDS)
@pytest.mark.parametrize("bs, kv_heads", [(1, 1), (1, 2), (3, 2)])
def test_thread_count_changes_no_bit(bs, kv_heads, pairs) -> None:
    """With more threads than (batch row, KV head) pairs the kernel splits a head's query rows
    between threads; each row is still computed alone, so the bits stay those of one thread."""
    query, key, value, mask = _inputs(bs, 4 * kv_heads, kv_heads, 9, 150, 64, torch.bfloat16, seed=bs + kv_heads)
    before = torch.get_num_threads()
    with _build(pairs):
        try:
            torch.set_num_threads(1)
            one = small_attention(query, key, value, mask, 0.125)
            torch.set_num_threads(4)
            four = small_attention(query, key, value, mask, 0.125)
        finally:
            torch.set_num_threads(before)
    assert torch.equal(one, four)
    _assert_as_accurate_as_ops(four, query, key, value, mask, 0.125)
