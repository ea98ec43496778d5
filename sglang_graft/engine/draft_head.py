"""A draft LM head over part of the vocabulary: the rows a draft can usefully propose.

A small draft model spends much of each forward in its LM head: Qwen2.5-0.5B's is
151,936 x 896 weights, about a fifth of every draft forward on 2 CPU cores (a forward over
4 tokens: 54-59 ms with the full head, 45-47 ms with the 32,768 lowest ids, measured),
yet the tokens it gets accepted come from a small part of the vocabulary. EAGLE-3 trains
its draft head on a reduced vocabulary for this reason; this is the training-free
version: the head keeps the rows of

* the ``keep`` lowest token ids: byte-level BPE tokenizers (Qwen, Llama 3, GPT-2 style)
  number tokens in merge order, so low ids are the frequent ones (on Spec-Bench's
  questions the first 32,768 of Qwen2.5's ids cover 92% of the tokens, 64k cover 97%);
* every token of the batch's prompts, so names and rare words the prompt introduces can
  still be drafted.

Lossless by construction: the draft only proposes, the target verifies. A token outside
the head is never drafted (retrieval can still propose it); the draft's probabilities are
renormalised over the kept rows, which the online calibration absorbs like any other
draft miscalibration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sglang_graft.engine.cpu_linear import KernelLinear, cpu_linear
from sglang_graft.engine.draft_int8 import CastLinear


class DraftHead:
    """The draft's LM head restricted to ``ids``; logits come back over those ids only
    (column ``j`` is token ``ids[j]``; ``columns`` maps a token to its column, -1 outside).
    The drafter takes its softmax and top-k over the kept columns: over the full vocabulary
    they cost more than the head itself (16 rows on 2 CPU cores: softmax and top-8 over
    151,936 columns 3.9 ms, over 32,768 0.5 ms).

    Args:
        model: the draft causal LM (its output embeddings must be a plain ``nn.Linear``).
        keep: the lowest token ids kept (>= 1).
        prompts: the batch's prompts; their tokens are kept too.
        vocab_limit: the target's vocabulary size (the kept ids lie below it; ``columns``
            covers it).
    """

    def __init__(self, model: torch.nn.Module, keep: int, prompts: Sequence[Sequence[int]], vocab_limit: int) -> None:
        if keep < 1:
            raise ValueError(f"draft vocabulary must keep >= 1 token ids, got {keep}")
        head = model.get_output_embeddings()
        if type(head) not in (torch.nn.Linear, CastLinear, KernelLinear):
            raise ValueError(
                f"--draft-vocab needs a draft whose LM head is a plain nn.Linear, got {type(head).__name__}; "
                "leave --draft-vocab out for this draft"
            )
        config = model.config.get_text_config()
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(config, attr, None):
                raise ValueError(f"--draft-vocab does not support a draft with {attr} set; leave it out for this draft")
        vocab = min(head.weight.shape[0], vocab_limit)
        rows = set(range(min(keep, vocab)))
        rows.update(t for p in prompts for t in p if t < vocab)
        self.ids = torch.tensor(sorted(rows), dtype=torch.int64, device=head.weight.device)
        self.columns = torch.full((vocab_limit,), -1, dtype=torch.int64, device=head.weight.device)
        self.columns[self.ids] = torch.arange(len(self.ids), device=head.weight.device)
        self.weight = head.weight.index_select(0, self.ids)
        self.bias = None if head.bias is None else head.bias.index_select(0, self.ids)
        self.kernel = isinstance(head, KernelLinear)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., len(ids)]`` logits from the draft's final hidden states ``[..., hidden]``, in
        the head's dtype (an ``int8_draft``'s hidden states are float32, its head is not), or
        through the CPU kernel when the head ran there, in the hidden states' dtype."""
        if self.kernel:
            return cpu_linear(hidden, self.weight, self.bias)
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)


def decoder_logits(
    model: torch.nn.Module, head: Callable[[torch.Tensor], torch.Tensor], logits_to_keep: int = 0, **inputs: Any
) -> torch.Tensor:
    """Logits of ``model``'s decoder (called with ``inputs``) through ``head`` instead of the
    model's own LM head, for only the last ``logits_to_keep`` positions (0: all)."""
    hidden = model.get_decoder()(**inputs).last_hidden_state
    return head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
