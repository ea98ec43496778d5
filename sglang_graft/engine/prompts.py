"""Prompts: Spec-Bench questions, plain prompt files, and the chat template.

Spec-Bench (``spec_bench_question.jsonl``) holds one JSON object per line with
``question_id``, ``category`` and ``turns``; the benchmark uses the first turn. Its eight
MT-bench categories are reported together as ``mt_bench``, as Spec-Bench itself does,
which leaves six: mt_bench, translation, summarization, qa, math_reasoning, rag.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

MT_BENCH = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    text: str


def load_questions(
    path: str, per_category: int | None = None, categories: Sequence[str] | None = None
) -> list[Question]:
    """The first turn of every question (the first ``per_category`` of each category, and
    only of ``categories`` when given: Spec-Bench's MT-bench categories count as ``mt_bench``).

    Raises ``ValueError`` naming the file and line of anything malformed, and naming the
    categories the file holds when one asked for is not among them.
    """
    if per_category is not None and per_category < 1:
        raise ValueError(f"--per-category must be >= 1, got {per_category}")
    if categories is not None and not categories:
        raise ValueError("--categories names no category (leave it out to run them all)")
    if not os.path.isfile(path):
        raise ValueError(f"questions file {path!r} does not exist")
    out: list[Question] = []
    taken: dict[str, int] = {}
    seen: dict[str, None] = {}  # every category of the file, in file order
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                qid, category, text = str(obj["question_id"]), str(obj["category"]), obj["turns"][0]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{lineno}: expected a Spec-Bench question "
                    f"{{'question_id', 'category', 'turns': [...]}}: {exc}"
                ) from None
            group = "mt_bench" if category in MT_BENCH else category
            seen.setdefault(group, None)
            if categories is not None and group not in categories:
                continue
            if per_category is not None and taken.get(group, 0) >= per_category:
                continue
            taken[group] = taken.get(group, 0) + 1
            out.append(Question(qid, group, str(text)))
    missing = [c for c in categories or () if c not in seen]
    if missing:
        raise ValueError(f"questions file {path!r} has no category {missing}; it holds {list(seen)}")
    if not out:
        raise ValueError(f"questions file {path!r} holds no questions")
    return out


def read_prompt_file(path: str) -> list[str]:
    """Prompts from a file: one per line, or JSON lines with ``prompt`` or ``turns``."""
    if not os.path.isfile(path):
        raise ValueError(f"--prompts {path!r}: no such file")
    prompts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                    prompts.append(str(obj["prompt"] if "prompt" in obj else obj["turns"][0]))
                except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
                    raise ValueError(f"{path}:{lineno}: a JSON line needs 'prompt' or 'turns': {exc}") from None
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts {path!r} holds no prompts")
    return prompts


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user turn: through the chat template when there is one and ``chat``."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError(f"prompt {text!r} encodes to no tokens")
    return list(ids)
