"""KV compaction: after verify rounds, the caches hold exactly the accepted sequence."""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import TEST_DEVICE
from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models
from sglang_graft.engine.kv import GROW_MIN_TOKENS, GrowingLayer, PaddedKV, causal_block, left_pad

PROMPTS = [[4, 5, 6, 7, 8, 9, 4, 5, 6], [20, 21], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def pair64():
    torch.set_num_threads(1)
    return tuple(m.to(TEST_DEVICE) for m in tiny_models("qwen3", vocab_size=150, seed=5, hidden=32, dtype=torch.float64))


def _next_logits(model, kv: PaddedKV, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Feed a left-padded block through the cache and return the last column's logits."""
    offsets, block = causal_block(valid)
    logits = kv.forward(model, tokens, kv.lengths.unsqueeze(1) + offsets, block)
    return logits[:, -1]


@pytest.mark.parametrize(
    "policy,drafts",
    [("dense", None), ("graft", None), ("graft", (True, False)), ("graft", (True, False, False, False))],
)
def test_compacted_caches_equal_a_fresh_forward(pair64, policy, drafts):
    """``drafts``: which rounds draft (cycled); in the others the drafter reads nothing and
    catches up later on every token verified meanwhile (None: the scheduler decides)."""
    target, draft = pair64
    engine = SpecEngine(target, draft, EngineConfig(policy=policy, num_nodes=6, draft_depth=3, draft_topk=2))
    if drafts is not None:
        decisions = itertools.cycle(drafts)
        engine.scheduler.wants_draft = lambda retrieved, unread, cold: next(decisions)
    run = engine.start(PROMPTS, max_new_tokens=40)
    for _ in range(4):
        run.round()
    assert len(run.rows) == 3
    sequences = [PROMPTS[r] + run.outputs[r].token_ids for r in run.rows]
    assert sum(len(run.outputs[r].token_ids) for r in run.rows) > 3 * 4, "no round accepted a proposal"
    with torch.inference_mode():
        # Target: every verified token but the root is cached; feeding the root must give
        # the same logits as a cache-free forward over the whole sequence.
        assert run.target_kv.lengths.tolist() == [len(s) - 1 for s in sequences]
        roots, root_valid = left_pad([s[-1:] for s in sequences], 0, TEST_DEVICE)
        cached = _next_logits(target, run.target_kv, roots, root_valid)
        # Draft: it has read everything but the pending tokens (which end at the root).
        pending = run.pending_valid.sum(dim=1)
        assert run.drafter.kv.lengths.tolist() == [len(s) - int(k) for s, k in zip(sequences, pending)]
        draft_cached = _next_logits(draft, run.drafter.kv, run.pending, run.pending_valid)
        for b, s in enumerate(sequences):
            fresh = target(torch.tensor([s], device=TEST_DEVICE)).logits[0, -1]
            torch.testing.assert_close(cached[b], fresh, rtol=0, atol=1e-9)
            fresh_d = draft(torch.tensor([s], device=TEST_DEVICE)).logits[0, -1]
            torch.testing.assert_close(draft_cached[b], fresh_d, rtol=0, atol=1e-9)


@torch.inference_mode()  # as the engine runs: views made there do not record their base
def test_commit_repacks_rows_right_aligned():
    kv = PaddedKV(2, "cpu")
    layer_keys = torch.arange(2 * 5, dtype=torch.float64).view(2, 1, 5, 1)
    kv.cache.update(layer_keys, layer_keys.clone(), 0)
    kv.valid = torch.zeros(2, 5, dtype=torch.bool)
    buffer = kv.cache.layers[0].keys.data_ptr()
    keep = torch.tensor([[True, False, True, True, False], [False, True, False, False, True]])
    kv.commit(keep)
    assert kv.cache.layers[0].keys.data_ptr() == buffer, "compaction copied the cache instead of moving in place"
    assert kv.lengths.tolist() == [3, 2]
    assert kv.valid.tolist() == [[True, True, True], [False, True, True]]
    keys = kv.cache.layers[0].keys[:, 0, :, 0]
    assert keys[0].tolist() == [0.0, 2.0, 3.0]
    assert keys[1, 1:].tolist() == [6.0, 9.0]
    kv.select_rows(torch.tensor([1]))
    assert kv.valid.tolist() == [[True, True]]
    assert kv.cache.layers[0].keys[0, 0, :, 0].tolist() == [6.0, 9.0]


def test_draft_reuses_the_kv_of_accepted_draft_nodes():
    torch.set_num_threads(1)
    target, draft = (m.to(TEST_DEVICE) for m in tiny_models("llama", vocab_size=200, seed=1, hidden=32))
    reads: list[int] = []
    handle = draft.register_forward_pre_hook(lambda m, a, k: reads.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        engine = SpecEngine(target, draft, EngineConfig(policy="dense", num_nodes=8, draft_depth=3, draft_topk=3))
        out = engine.generate([[3, 1, 4, 1, 5, 9, 2, 6]], 30).requests[0]
    finally:
        handle.remove()
    # Forwards per round: the tokens not read yet (in the first round the whole prompt:
    # the drafter reads it lazily), then two tree levels of 3 nodes.
    first_reads = reads[0::3]
    assert len(first_reads) == out.rounds and out.tau > 2
    assert first_reads[0] == 8, "the first draft forward reads the prompt"
    later = first_reads[1:]
    assert sum(later) < len(later) * out.tau / 2, "accepted draft nodes were re-read instead of kept"


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_chunked_prefill_equals_a_fresh_forward(pair64, chunk):
    """A left-padded batch of prompts read ``chunk`` columns per forward: every row's cache
    then gives the logits a cache-free forward over its prompt gives."""
    target, _ = pair64
    heads, valid = left_pad([p[:-1] for p in PROMPTS], 0, TEST_DEVICE)
    kv = PaddedKV(len(PROMPTS), TEST_DEVICE)
    with torch.inference_mode():
        kv.prefill(target, heads, valid, chunk=chunk)
        assert kv.lengths.tolist() == [len(p) - 1 for p in PROMPTS]
        assert kv.valid.tolist() == valid.tolist()
        roots, root_valid = left_pad([p[-1:] for p in PROMPTS], 0, TEST_DEVICE)
        cached = _next_logits(target, kv, roots, root_valid)
        for b, p in enumerate(PROMPTS):
            fresh = target(torch.tensor([p], device=TEST_DEVICE)).logits[0, -1]
            torch.testing.assert_close(cached[b], fresh, rtol=0, atol=1e-9)


def test_prefill_refuses_an_empty_chunk(pair64):
    heads, valid = left_pad([[1, 2]], 0, TEST_DEVICE)
    with pytest.raises(ValueError, match="prefill chunk must be >= 1 tokens, got 0"):
        PaddedKV(1, TEST_DEVICE).prefill(pair64[0], heads, valid, chunk=0)


def _appended(chunks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(chunks, dim=2)


@torch.inference_mode()
def test_growing_layer_appends_in_place_with_bounded_room():
    layer = GrowingLayer()
    gen = torch.Generator().manual_seed(0)
    chunks: list[torch.Tensor] = []
    moves = 0
    for step in range(300):
        new = torch.randn(2, 3, 1 if step else 40, 8, generator=gen)
        before = layer.keys.data_ptr() if layer.is_initialized and layer.keys.numel() else None
        keys, values = layer.update(new, -new)
        chunks.append(new)
        moves += before is not None and keys.data_ptr() != before
        length = keys.shape[2]
        assert torch.equal(keys, _appended(chunks)) and torch.equal(values, -_appended(chunks))
        assert layer.get_seq_length() == length
        room = layer._room[0].shape[2]
        assert room <= length + max(GROW_MIN_TOKENS, length // 8), f"room {room} for {length} tokens is unbounded"
    # 40 + 299 tokens one at a time: the buffer moved a handful of times, not every step.
    assert 1 <= moves <= 4


@torch.inference_mode()
def test_growing_layer_adopts_keys_replaced_from_outside():
    """A row selection or a cast replaces ``keys`` with a new tensor: the next update
    continues from that content, not from the stale buffer."""
    layer = GrowingLayer()
    first = torch.arange(2 * 1 * 4 * 2, dtype=torch.float32).view(2, 1, 4, 2)
    layer.update(first, first + 100)
    layer.keys, layer.values = layer.keys[[1]], layer.values[[1]]
    new = torch.full((1, 1, 1, 2), -1.0)
    keys, values = layer.update(new, new)
    assert torch.equal(keys, torch.cat([first[[1]], new], dim=2))
    assert torch.equal(values, torch.cat([first[[1]] + 100, new], dim=2))
    layer.keys, layer.values = layer.keys.to(torch.float64), layer.values.to(torch.float64)
    keys, _ = layer.update(new.double(), new.double())
    assert keys.dtype == torch.float64 and keys.shape[2] == 6
    assert torch.equal(keys[:, :, :5], torch.cat([first[[1]], new], dim=2).double())
