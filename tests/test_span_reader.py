"""A span reader: another model (the bf16 source of an int8 draft) reads long unread spans
for the drafter, whose cache then holds that KV in its own dtype."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models
from sglang_graft.engine.cpu_linear import KernelLinear, unavailable_reason, use_cpu_kernel
from sglang_graft.engine.draft_int8 import CastLinear, int8_draft, span_reader
from sglang_graft.engine.drafter import ModelDrafter

VOCAB = 64


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return tiny_models("qwen2", vocab_size=VOCAB, seed=4, hidden=32, dtype=torch.float64)


def _always(depth: int, scores: torch.Tensor) -> torch.Tensor:
    return torch.ones(scores.shape[0], dtype=torch.bool)


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    return tokens, valid


def test_reader_reads_long_spans_and_drafting_matches(models):
    _, draft = models
    reader = copy.deepcopy(draft).to(torch.float32)
    reads: list[tuple[str, int]] = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, a, kw, n=name: reads.append((n, kw["input_ids"].shape[1])), with_kwargs=True)
        for name, m in (("draft", draft.get_decoder()), ("reader", reader.get_decoder()))
    ]
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 6)]
    tokens, valid = _left_padded(rows)
    try:
        with torch.inference_mode():
            plain = ModelDrafter(draft, topk=3, depth=3, vocab_limit=VOCAB, batch_size=2, device="cpu")
            want = plain.draft(tokens, valid, _always).candidates
            reads.clear()
            read = ModelDrafter(draft, 3, 3, VOCAB, 2, "cpu", span_reader=reader, span_min=5)
            got = read.draft(tokens, valid, _always).candidates
            # Next round: a short span is the drafting model's own read.
            read.draft(torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2, dtype=torch.bool), _always)
    finally:
        for h in hooks:
            h.remove()
    # The reader read all but the root (8 columns, left padding included), the draft the rest.
    assert reads[:4] == [("reader", 8), ("draft", 1), ("draft", 3), ("draft", 3)]
    assert reads[4] == ("draft", 2) and {name for name, _ in reads[4:]} == {"draft"}
    assert all(layer.keys.dtype == torch.float64 for layer in read.kv.cache.layers)
    assert torch.equal(read.kv.lengths, torch.tensor([9 + 2, 6 + 2]))
    # Float32 KV from the reader instead of float64: same tree, scores to float32 precision.
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-4, atol=1e-6)


def test_engine_with_a_reader_is_lossless(models, monkeypatch):
    target, draft = models
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 12, 90)]
    ar = SpecEngine(target, draft, EngineConfig(policy="ar")).generate(prompts, 24)
    engine = SpecEngine(target, draft, EngineConfig(policy="graft", num_nodes=8))
    reader = copy.deepcopy(draft).to(torch.float32)
    reads: list[int] = []
    reader.get_decoder().register_forward_pre_hook(lambda m, a, kw: reads.append(kw["input_ids"].shape[1]), with_kwargs=True)
    monkeypatch.setattr("sglang_graft.engine.decoder.span_reader", lambda model: reader)
    out = engine.generate(prompts, 24)
    assert reads == [89]  # the batch's longest prompt, left-padded, but its root
    assert [r.token_ids for r in out.requests] == [r.token_ids for r in ar.requests]
    assert sum(r.draft_forwards for r in out.requests) > 0


def test_reader_reads_the_first_span_however_short(models):
    _, draft = models
    reader = copy.deepcopy(draft).to(torch.float32)
    reads: list[int] = []
    reader.get_decoder().register_forward_pre_hook(lambda m, a, kw: reads.append(kw["input_ids"].shape[1]), with_kwargs=True)
    drafter = ModelDrafter(draft, 3, 2, VOCAB, 1, "cpu", span_reader=reader)  # span_min: 64
    with torch.inference_mode():
        drafter.draft(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool), _always)
        drafter.draft(torch.tensor([[8, 9, 10]]), torch.ones(1, 3, dtype=torch.bool), _always)
    assert reads == [2]  # the prompt but its root, first token included; later short spans are the draft's


def test_span_reader_is_the_bf16_source_of_an_int8_draft(models, monkeypatch):
    _, draft = models
    assert span_reader(draft) is None  # not an int8 draft
    bf16 = copy.deepcopy(draft).to(torch.bfloat16)
    int8_linear = torch.ao.nn.quantized.dynamic.Linear
    monkeypatch.setattr("sglang_graft.engine.draft_int8.cpu_flags", lambda: frozenset({"avx512_bf16"}))
    quantized = int8_draft(bf16, "fbgemm")  # the same module kinds on every host
    assert span_reader(quantized) is bf16
    # The bf16 source reads the prompts, so the MLP output projections are int8 too.
    assert all(type(layer.mlp.down_proj) is int8_linear for layer in quantized.model.layers)
    monkeypatch.setattr("sglang_graft.engine.draft_int8.cpu_flags", lambda: frozenset({"avx2"}))
    alone = int8_draft(bf16, "fbgemm")
    assert span_reader(alone) is None  # no native bf16: the int8 draft reads faster
    assert all(type(layer.mlp.down_proj) is CastLinear for layer in alone.model.layers)
    monkeypatch.setattr("sglang_graft.engine.draft_int8.cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert span_reader(int8_draft(copy.deepcopy(draft).to(torch.float32))) is None  # a float32 source
    # The reader is no submodule: the int8 draft's parameters are its own (float32 and kept bf16 ones).
    names = {n for n, _ in quantized.named_parameters()}
    assert not any("_graft_reader" in n for n in names)


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"CPU kernel: {unavailable_reason()}")
@pytest.mark.parametrize("bf16_dot", [True, False])
def test_a_kernel_draft_reads_spans_only_on_the_bf16_dot_path(models, monkeypatch, bf16_dot):
    _, draft = models
    bf16 = copy.deepcopy(draft).to(torch.bfloat16)
    use_cpu_kernel(bf16)
    monkeypatch.setattr("sglang_graft.engine.draft_int8.cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr("sglang_graft.engine.draft_int8.bf16_dot_available", lambda: bf16_dot)
    quantized = int8_draft(bf16, "fbgemm")
    # AVX512-BF16 products read a prompt as fast as PyTorch's native bf16 ones; the AVX2 path's
    # widened float32 ones do not, and there the int8 draft reads and keeps down_proj as loaded.
    assert (span_reader(quantized) is bf16) is bf16_dot
    kept = {type(layer.mlp.down_proj) for layer in quantized.model.layers}
    assert kept == ({torch.ao.nn.quantized.dynamic.Linear} if bf16_dot else {KernelLinear})
