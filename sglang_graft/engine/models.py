"""Loading the target/draft pair, checking it before any weights are read, and tiny models.

Every check that can fail (a path that is not a model folder, two tokenizers that
disagree, a model whose attention the engine cannot mask) runs on the configs and
tokenizers, which load in milliseconds, so a bad command fails before the seconds to
minutes of weight loading.

``tiny`` stands for a small seeded random model built in-process (no download): a byte
tokenizer, a target, and a draft that is the target with seeded noise on every weight,
so the draft agrees with the target often but not always. Tests and smoke runs use it.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from sglang_graft.engine.int8_linear import Int8Linear
from sglang_graft.engine.attention import use_gqa_attention
from sglang_graft.engine.cpu_linear import use_cpu_kernel, wants_cpu_kernel

TINY = "tiny"
TINY_ARCHS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelPair:
    """What the engine runs: the target, an optional draft model, and their tokenizer."""

    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: PreTrainedTokenizerBase

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the generation config (preferred) or the tokenizer."""
        gen = getattr(self.target, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def check_model_path(path: str, role: str) -> None:
    """Raise ``ValueError`` unless ``path`` is ``tiny`` or a folder with a ``config.json``."""
    if path == TINY:
        return
    if not os.path.isdir(path):
        raise ValueError(f"--{role} {path!r}: not a directory (expected a transformers model folder, or 'tiny')")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--{role} {path!r}: no config.json in that folder (expected a transformers model folder)")


def require_full_attention(config: PretrainedConfig, role: str) -> None:
    """The engine masks attention itself over a plain growing cache: sliding windows would
    need per-layer masks it does not build, so such models are refused up front."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [t for t in layer_types if t != "full_attention"]
    if sliding or getattr(config, "use_sliding_window", False):
        raise ValueError(
            f"the {role} model uses {sorted(set(sliding)) or ['sliding_window']} attention layers; "
            "the reference engine supports full-attention causal LMs only"
        )


def check_tokenizers(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """A draft proposes token ids the target must read the same way: vocabularies must match."""
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv != dv:
        only_t = len(tv.keys() - dv.keys())
        only_d = len(dv.keys() - tv.keys())
        moved = sum(1 for k in tv.keys() & dv.keys() if tv[k] != dv[k])
        raise ValueError(
            f"target and draft tokenizers differ (target {len(tv)} tokens, draft {len(dv)}; "
            f"{only_t} only in target, {only_d} only in draft, {moved} with different ids): "
            "the draft must share the target's tokenizer"
        )


def prepare_pair(
    target: str,
    draft: str | None,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    cpu_kernel: str = "auto",
) -> ModelPair:
    """Validate both paths, configs and tokenizers, then load the weights.

    ``draft`` may be None for policies that use no draft model. ``tiny`` builds seeded
    random models in-process; a tiny target needs a tiny draft (or none) and vice versa.
    ``cpu_kernel`` (``auto``, ``on``, ``off``): run both models' linear layers through the
    project's AVX2 kernel (``engine.cpu_linear.wants_cpu_kernel``); unless ``off``, small
    attention blocks take the project's AVX512 kernel where the CPU has it
    (``engine.attention.small_attention``).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    kernel = wants_cpu_kernel(cpu_kernel, torch_dtype, device)
    check_model_path(target, "target")
    if draft is not None:
        check_model_path(draft, "draft")
        if (target == TINY) != (draft == TINY):
            raise ValueError("--target tiny and --draft tiny go together (a tiny model shares no tokenizer with a real one)")
    if target == TINY:
        t, d, tok = tiny_pair(seed=seed, dtype=torch_dtype)
        t, d = t.to(device), d.to(device) if draft is not None else None
    else:
        tok = AutoTokenizer.from_pretrained(target)
        require_full_attention(AutoConfig.from_pretrained(target), "target")
        if draft is not None:
            check_tokenizers(tok, AutoTokenizer.from_pretrained(draft))
            require_full_attention(AutoConfig.from_pretrained(draft), "draft")
        t = _load(target, torch_dtype, device)
        d = _load(draft, torch_dtype, device) if draft is not None else None
    for model in (t, d) if d is not None else (t,):
        use_gqa_attention(model, kernel=cpu_kernel != "off")
        if kernel:
            use_cpu_kernel(model)
    return ModelPair(t, d, tok)


def weight_cost_ratio(draft: torch.nn.Module, target: torch.nn.Module, draft_vocab: int = 0) -> float:
    """Draft / target bytes of matmul weights (every ``nn.Linear`` and int8 linear, the LM head included;
    with ``draft_vocab``, only that many rows of the draft's head, as ``DraftHead`` keeps).

    Decoding a few tokens streams every matmul weight once per forward, so this ratio is a
    deterministic first guess of the draft forward's cost relative to the target's; it
    underestimates on small models, whose fixed per-layer overheads weigh more.
    """

    def linear_bytes(model: torch.nn.Module) -> int:
        seen: set[int] = set()
        total = 0
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
                seen.add(id(m.weight))
                total += m.weight.numel() * m.weight.element_size()
            elif isinstance(m, torch.ao.nn.quantized.dynamic.Linear):  # an ``int8_draft``'s
                total += m.weight().numel()  # one byte per int8 weight
            elif isinstance(m, Int8Linear):
                total += m.packed.numel()
        return total

    draft_bytes = linear_bytes(draft)
    head = draft.get_output_embeddings() if draft_vocab else None
    if isinstance(head, torch.nn.Linear):
        rows, cols = head.weight.shape
        draft_bytes -= max(rows - draft_vocab, 0) * cols * head.weight.element_size()
    target_bytes = linear_bytes(target)
    return draft_bytes / target_bytes if target_bytes else 1.0


def _load(path: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 257-token byte-level tokenizer (256 bytes + ``<eos>``): any text round-trips."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_config(arch: str = "llama", vocab_size: int = 257, hidden: int = 64, layers: int = 2) -> PretrainedConfig:
    """A small config of one of ``TINY_ARCHS``; a large init range gives peaked, tie-free logits."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"tiny arch must be one of {sorted(TINY_ARCHS)}, got {arch!r}")
    return TINY_ARCHS[arch](
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )


def tiny_models(
    arch: str = "llama",
    vocab_size: int = 257,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    draft_noise: float = 0.03,
    hidden: int = 64,
    layers: int = 2,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Seeded random target and a correlated draft: the target plus seeded noise of
    ``draft_noise`` times each weight's spread (0.03 makes most, not all, drafts agree)."""
    config = tiny_config(arch, vocab_size, hidden, layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        target = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            scale = float(p.std()) if p.numel() > 1 else 0.0
            p.add_(torch.randn(p.shape, generator=gen) * draft_noise * scale)
    for model in (target, draft):
        use_gqa_attention(model)
    return target.to(dtype).eval(), draft.to(dtype).eval()


def tiny_pair(
    arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, torch.nn.Module, PreTrainedTokenizerFast]:
    """``tiny_models`` over the byte tokenizer's vocabulary, with that tokenizer."""
    tokenizer = byte_tokenizer()
    target, draft = tiny_models(arch, len(tokenizer), seed, dtype)
    for m in (target, draft):
        m.generation_config.eos_token_id = tokenizer.eos_token_id
    return target, draft, tokenizer
