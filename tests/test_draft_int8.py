"""``--draft-int8``: the draft's matmuls as dynamic int8 on the CPU.

The quantized copy must leave the loaded draft untouched, keep the MLP output projections
and the LM head in the loaded dtype (as linear layers ``DraftHead`` can slice), stay close
to the loaded draft's logits, and, since the draft only proposes, leave every policy
token-for-token equal to ``ar``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models
from sglang_graft.engine.draft_head import DraftHead
from sglang_graft.engine.draft_int8 import CastLinear, int8_draft, is_int8_draft
from sglang_graft.engine.models import weight_cost_ratio

VOCAB = 200
PROMPTS = [[11, 12, 13, 150, 11, 12, 13, 150, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 181], [42, 7]]


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return tiny_models("qwen2", vocab_size=VOCAB, seed=1, hidden=32)


def test_copy_is_quantized_but_for_the_kept_projections_and_leaves_the_draft_alone(models):
    target, draft = models
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    q = int8_draft(draft)
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
    torch.testing.assert_close(mine[..., head.ids], full[..., head.ids])


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
