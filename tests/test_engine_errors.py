"""Bad settings, paths and model pairs fail with clear errors before any weights load."""

from __future__ import annotations

import pytest

from sglang_graft.engine import EngineConfig, SamplingConfig, SpecEngine, prepare_pair, tiny_models
from sglang_graft.engine.models import byte_tokenizer, tiny_config


def test_config_errors_name_the_value_and_range():
    with pytest.raises(ValueError, match=r"num_nodes .* must be >= 2, got 1"):
        EngineConfig(policy="graft", num_nodes=1)
    with pytest.raises(ValueError, match=r"policy must be one of .*'ar'.*got 'eagle'"):
        EngineConfig(policy="eagle")
    with pytest.raises(ValueError, match=r"draft_depth must be >= 1, got 0"):
        EngineConfig(draft_depth=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingConfig(temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match=r"temperature must be >= 0"):
        SamplingConfig(temperature=-1.0)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match=r"--target .*not a directory"):
        prepare_pair(str(tmp_path / "missing"), None)
    with pytest.raises(ValueError, match=r"--target .*no config.json"):
        prepare_pair(str(tmp_path), None)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tiny go together"):
        prepare_pair("tiny", str(tmp_path))
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        prepare_pair("tiny", "tiny", dtype="int8")
    # Checked before any weights load: a bad mode, or 'on' where the kernel cannot run.
    with pytest.raises(ValueError, match=r"--cpu-kernel must be one of"):
        prepare_pair(str(tmp_path / "missing"), None, cpu_kernel="yes")
    with pytest.raises(ValueError, match=r"--cpu-kernel on: .*float16"):
        prepare_pair(str(tmp_path / "missing"), None, dtype="float16", cpu_kernel="on")


def _folder(path, tokenizer, **config_overrides):
    """A model folder with a config and a tokenizer but no weights: loading any would fail."""
    path.mkdir()
    config = tiny_config("qwen2")
    for k, v in config_overrides.items():
        setattr(config, k, v)
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_tokenizer_mismatch_is_caught_before_loading_weights(tmp_path):
    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    target = _folder(tmp_path / "t", byte_tokenizer())
    draft = _folder(tmp_path / "d", other)
    with pytest.raises(ValueError, match=r"tokenizers differ .*1 only in draft"):
        prepare_pair(target, draft)


def test_sliding_window_models_are_refused_before_loading(tmp_path):
    target = _folder(tmp_path / "t", byte_tokenizer(), use_sliding_window=True, sliding_window=16)
    with pytest.raises(ValueError, match=r"full-attention causal LMs only"):
        prepare_pair(target, None)


def test_prompt_and_policy_errors_before_decoding():
    target, draft = tiny_models("llama", vocab_size=64, hidden=16, layers=1)
    with pytest.raises(ValueError, match=r"policy 'graft' needs a draft model"):
        SpecEngine(target, None, EngineConfig(policy="graft"))
    engine = SpecEngine(target, draft, EngineConfig(policy="dense"))
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"prompt 1 holds token id 64, outside the vocabulary \[0, 64\)"):
            engine.generate([[1, 2], [3, 64]], 4)
        with pytest.raises(ValueError, match=r"prompt 0 is empty"):
            engine.generate([[]], 4)
        with pytest.raises(ValueError, match=r"max_new_tokens must be >= 1, got 0"):
            engine.generate([[1]], 0)
    finally:
        handle.remove()
    assert not calls, "the target ran before the inputs were checked"


def test_requests_past_a_models_context_window_are_refused_before_decoding():
    target, draft = tiny_models("llama", vocab_size=64, hidden=16, layers=1)
    target.config.max_position_embeddings = 32
    draft.config.max_position_embeddings = 16
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        ar = SpecEngine(target, draft, EngineConfig(policy="ar"))  # plain decoding never runs the draft
        with pytest.raises(ValueError, match=r"prompt 0 \(10 tokens\) with max_new_tokens 23 needs 33 positions of "
                                             r"the target model, whose context window is 32 .*at most 22"):
            ar.generate([[1] * 10], 23)
        with pytest.raises(ValueError, match=r"prompt 1 \(40 tokens\).*shorten it below 32 tokens"):
            ar.generate([[1] * 4, [1] * 40], 1)
        dense = SpecEngine(target, draft, EngineConfig(policy="dense"))
        with pytest.raises(ValueError, match=r"needs 22 positions of the draft model, whose context window is 16 "
                                             r"\(max_position_embeddings\): lower max_new_tokens to at most 6"):
            dense.generate([[1] * 10], 12)
    finally:
        handle.remove()
    assert not calls, "the target ran before the request was checked"
    # The draft reads only the prompt's last ``draft_window`` tokens, so those are what must fit.
    windowed = SpecEngine(target, draft, EngineConfig(policy="dense", draft_window=4))
    assert len(windowed.generate([[1] * 10], 12).requests[0].token_ids) == 12
    assert len(ar.generate([[1] * 10], 22).requests[0].token_ids) == 22
