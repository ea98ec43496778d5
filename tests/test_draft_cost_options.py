"""What makes drafting cheaper: a head over part of the vocabulary (``--draft-vocab``), a
window over the prompt (``--draft-window``) and int8 matmuls (``--draft-int8``).

The head must compute exactly the draft's own logits on the rows it keeps (the lowest ids
and the prompts' tokens), and nothing else, so the draft never proposes another token; the window must cut what the draft reads; the int8 copy must leave the loaded
draft untouched, keep the MLP output projections and the LM head in the loaded dtype (as
linear layers ``DraftHead`` can slice) and stay close to the loaded draft's logits. Since
the draft only proposes, every policy stays token-for-token equal to ``ar`` either way.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_graft.candidates import Source
from sglang_graft.cli import main
from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models
from sglang_graft.engine.draft_head import DraftHead
from sglang_graft.engine.draft_int8 import CastLinear, int8_draft, is_int8_draft
from sglang_graft.engine.drafter import ModelDrafter
from sglang_graft.engine.models import weight_cost_ratio

VOCAB = 200
KEEP = 60
PROMPTS = [[11, 12, 13, 150, 11, 12, 13, 150, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 181], [42, 7]]


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return tiny_models("qwen2", vocab_size=VOCAB, seed=1, hidden=32)


def _always(depth: int, scores: torch.Tensor) -> torch.Tensor:
    return torch.ones(scores.shape[0], dtype=torch.bool)


def test_head_keeps_low_ids_and_prompt_tokens_with_the_models_own_logits(models):
    _, draft = models
    head = DraftHead(draft, KEEP, PROMPTS, VOCAB)
    assert head.ids.tolist() == sorted(set(range(KEEP)) | {150, 181})
    x = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        full = draft(x).logits
        mine = head(draft.get_decoder()(x).last_hidden_state)
    assert mine.shape[-1] == len(head.ids)
    torch.testing.assert_close(mine, full[..., head.ids])
    # ``columns`` maps every kept token to its column, every other one to -1.
    assert head.columns[head.ids].tolist() == list(range(len(head.ids)))
    assert int((head.columns >= 0).sum()) == len(head.ids) and head.columns.shape == (VOCAB,)


def test_drafts_come_from_the_head_only(models):
    _, draft = models
    head = DraftHead(draft, KEEP, PROMPTS[:1], VOCAB)
    drafter = ModelDrafter(draft, topk=4, depth=3, vocab_limit=VOCAB, batch_size=1, device="cpu", head=head)
    tokens = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        out = drafter.draft(tokens, torch.ones_like(tokens, dtype=torch.bool), _always)
    c = out.candidates
    drafted = c.tokens[c.valid & (c.sources == int(Source.DRAFT))]
    assert out.forwards == 3 and drafted.numel() >= 12
    assert bool(torch.isin(drafted, head.ids).all())


@pytest.mark.parametrize("policy", ["dense", "graft"])
def test_policies_with_a_small_head_equal_ar(models, policy):
    target, draft = models
    ref = SpecEngine(target, None, EngineConfig(policy="ar")).generate(PROMPTS, 24)
    engine = SpecEngine(target, draft, EngineConfig(policy=policy, num_nodes=8, draft_depth=3, draft_topk=3, draft_vocab=KEEP))
    outs = []
    for p, r in zip(PROMPTS, ref.requests):
        outs.append(engine.generate([p], 24).requests[0])
        assert outs[-1].token_ids == r.token_ids
    batch = engine.generate(PROMPTS, 24)
    assert [r.token_ids for r in batch.requests] == [r.token_ids for r in ref.requests]
    outs += batch.requests
    assert sum(r.accepted["draft"] for r in outs) > 0, "no draft accepted: the test would prove nothing"


def test_cost_ratio_counts_only_the_kept_head_rows(models):
    target, draft = models
    full = weight_cost_ratio(draft, target)
    assert weight_cost_ratio(draft, target, KEEP) < full
    assert weight_cost_ratio(draft, target, 10 * VOCAB) == full


def test_bad_draft_vocab_is_refused(models, capsys):
    _, draft = models
    with pytest.raises(ValueError, match="draft_vocab must be >= 0"):
        EngineConfig(policy="graft", draft_vocab=-1)
    with pytest.raises(ValueError, match="must keep >= 1 token ids, got 0"):
        DraftHead(draft, 0, PROMPTS, VOCAB)
    original = draft.get_output_embeddings
    draft.get_output_embeddings = lambda: torch.nn.Identity()
    try:
        with pytest.raises(ValueError, match="plain nn.Linear, got Identity"):
            DraftHead(draft, KEEP, PROMPTS, VOCAB)
    finally:
        draft.get_output_embeddings = original
    argv = ["generate", "--target", "tiny", "--draft", "tiny", "--prompt", "x", "--draft-vocab", "-5"]
    assert main(argv) == 2
    assert "draft_vocab must be >= 0 token ids (0: the full LM head), got -5" in capsys.readouterr().err


def test_draft_window_reads_only_the_prompts_tail_and_stays_lossless(models, monkeypatch):
    """``draft_window``: the draft prefills only the last tokens of each prompt."""
    target, draft = models
    ref = SpecEngine(target, None, EngineConfig(policy="ar")).generate(PROMPTS, 24)
    widths: list[int] = []
    original = draft.forward

    def spy(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(draft, "forward", spy)
    engine = SpecEngine(target, draft, EngineConfig(policy="dense", num_nodes=8, draft_depth=3, draft_topk=3, draft_window=4))
    out = engine.generate([PROMPTS[1]], 24).requests[0]
    assert widths[0] == 4  # the prompt holds 11 tokens; the first draft forward reads its last 4
    assert out.token_ids == ref.requests[1].token_ids
    batch = SpecEngine(target, draft, EngineConfig(policy="graft", num_nodes=8, draft_window=4)).generate(PROMPTS, 24)
    assert [r.token_ids for r in batch.requests] == [r.token_ids for r in ref.requests]
    with pytest.raises(ValueError, match="draft_window must be >= 0 prompt tokens"):
        EngineConfig(policy="graft", draft_window=-1)


# ---------------------------------------------------------------- --draft-int8


def test_copy_is_quantized_but_for_the_kept_projections_and_leaves_the_draft_alone(models):
    target, draft = models
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    q = int8_draft(draft, "fbgemm")  # the same module kinds on every host (tests/test_int8_linear.py: amx, vnni)
    assert is_int8_draft(q) and not is_int8_draft(draft)
    assert int8_draft(q) is q  # already quantized: returned as is
    after = draft.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    kinds = {name: type(m) for name, m in q.named_modules()}
    down = [n for n in kinds if n.endswith("mlp.down_proj")]
    assert down and all(kinds[n] is CastLinear for n in down)
    assert type(q.get_output_embeddings()) is CastLinear
    int8 = [n for n, k in kinds.items() if k is torch.ao.nn.quantized.dynamic.Linear]
    assert any(n.endswith("self_attn.q_proj") for n in int8) and any(n.endswith("mlp.up_proj") for n in int8)
    assert not any(k is torch.nn.Linear for k in kinds.values())
    # int8 weights count one byte each: the quantized draft looks cheaper than the loaded one.
    assert weight_cost_ratio(q, target) < weight_cost_ratio(draft, target)


def test_logits_stay_close_to_the_loaded_draft(models):
    _, draft = models
    q = int8_draft(draft)
    x = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        ref = draft(x).logits
        got = q(x).logits
    assert got.dtype == ref.dtype and got.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert float(cos) > 0.99
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8


def test_draft_head_slices_the_kept_lm_head(models):
    _, draft = models
    q = int8_draft(draft)
    head = DraftHead(q, 60, PROMPTS, VOCAB)
    x = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        full = q(x).logits
        mine = head(q.get_decoder()(x).last_hidden_state)
    torch.testing.assert_close(mine, full[..., head.ids])


@pytest.mark.parametrize("policy", ["dense", "graft"])
def test_policies_with_an_int8_draft_equal_ar(models, policy):
    target, draft = models
    ref = SpecEngine(target, None, EngineConfig(policy="ar")).generate(PROMPTS, 24)
    engine = SpecEngine(
        target, draft, EngineConfig(policy=policy, num_nodes=8, draft_depth=3, draft_topk=3, draft_int8=True)
    )
    assert is_int8_draft(engine.draft) and not is_int8_draft(draft)
    outs = [engine.generate([p], 24).requests[0] for p in PROMPTS]
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref.requests]
    batch = engine.generate(PROMPTS, 24)
    assert [r.token_ids for r in batch.requests] == [r.token_ids for r in ref.requests]
    assert sum(r.accepted["draft"] for r in outs + batch.requests) > 0, "no draft accepted: the test would prove nothing"


def test_off_the_cpu_is_refused_by_name(models):
    off_cpu = copy.deepcopy(models[1]).to("meta")
    with pytest.raises(ValueError, match="CPU only.*meta"):
        int8_draft(off_cpu)
