"""Replay recorded greedy outputs through retrieval, without a model.

Under greedy decoding a verify round accepts the longest path of its tree that spells
the target's own next tokens, and the bonus token is the target's next one. So once a
request's prompt, the target's greedy output and its top-k at every output position are
recorded (``scripts/replay_retrieval.py record``), every round of a retrieval-only policy
can be replayed exactly: the real ``Retriever`` and ``GraftScheduler`` build each tree,
the recorded output says what the target accepts, and the recycling table is fed the
recorded top-k along the accepted path (the engine also feeds it the rejected nodes' top-k,
which a recording cannot know, so the replay slightly undersells recycling). A round costs
what the host's verify-cost curve says its width costs. Retrieval settings then compare in
seconds instead of a benchmark's minutes (docs/BENCHMARKS.md, "Context matches from one token").

Prompt lookup (transformers' rule: the earliest earlier occurrence of the last two tokens,
else of the last one, and up to ``tokens`` tokens that followed it, cut before a stop
token) replays the same way, as the reference point such settings have to beat.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from sglang_graft.cost import VerifyCost
from sglang_graft.retrieval.retriever import Retriever, RetrieverConfig
from sglang_graft.scheduler import GraftScheduler, SchedulerConfig


@dataclass(frozen=True)
class Recording:
    """One request as the target decoded it greedily.

    Attributes:
        category: a label results are grouped by.
        prompt: the prompt's token ids (at least one).
        output: the target's greedy output.
        topk: the target's top-k ids before each output token (``topk[i][0] == output[i]``).
    """

    category: str
    prompt: Sequence[int]
    output: Sequence[int]
    topk: Sequence[Sequence[int]]

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"a recording needs a prompt of at least one token (category {self.category!r})")
        if len(self.topk) != len(self.output):
            raise ValueError(f"a recording needs one top-k row per output token, got {len(self.topk)} rows for {len(self.output)} tokens")
        for i, (token, row) in enumerate(zip(self.output, self.topk)):
            if not row or row[0] != token:
                raise ValueError(f"top-k row {i} must start with the greedy output token {token}, got {list(row)[:3]}")


@dataclass
class Replayed:
    """What one method did on one recording: tokens emitted, verify rounds, tree nodes
    verified (roots included) and their cost in one-token forwards."""

    category: str
    tokens: int = 0
    rounds: int = 0
    verified: int = 0
    cost: float = 0.0

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0


def accepted_path(tokens: Sequence[int], parents: Sequence[int], truth: Sequence[int]) -> list[int]:
    """Columns of the longest path from the root (column 0) that spells ``truth``."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], []).append(i)
    path: list[int] = []
    node = 0
    for want in truth:
        node = next((c for c in children.get(node, ()) if tokens[c] == want), -1)
        if node < 0:
            break
        path.append(node)
    return path


def replay_retrieval(
    recordings: Sequence[Recording], retriever: RetrieverConfig, scheduler: SchedulerConfig
) -> list[Replayed]:
    """Every recording in order through one retriever and scheduler (their learned state
    carries over, as in a benchmark run); ``scheduler.policy`` must be ``retrieval``."""
    if scheduler.policy != "retrieval":
        raise ValueError(f"only the retrieval policy replays without a draft model, got {scheduler.policy!r}")
    source = Retriever(retriever)
    sched = GraftScheduler(scheduler, source)
    results = []
    for rid, rec in enumerate(recordings):
        out = Replayed(rec.category)
        source.start_request(rid, list(rec.prompt))
        pos = 0
        root = rec.prompt[-1]
        while pos < len(rec.output):
            tree = sched.build_tree([rid], torch.tensor([root]), None).tree
            path = accepted_path(tree.tokens[0].tolist(), tree.parents[0].tolist(), rec.output[pos:])
            accepted = torch.zeros(1, tree.num_nodes, dtype=torch.bool)
            accepted[0, [0, *path]] = True
            sched.observe([rid], tree, accepted)
            if source.recycling is not None:  # the target's top-k after the root and each accepted node
                seen = [root, *rec.output[pos : pos + len(path)]][: len(rec.output) - pos]  # none after the last
                source.recycling.update(torch.tensor([seen]), torch.tensor([rec.topk[pos : pos + len(seen)]]))
            emitted = list(rec.output[pos : pos + len(path) + 1])
            source.append(rid, emitted)
            pos += len(emitted)
            root = emitted[-1]
            out.tokens += len(emitted)
            out.rounds += 1
            out.verified += tree.num_nodes
            out.cost += sched.verify_cost(tree.num_nodes) if sched.verify_cost is not None else 1.0
        source.finish_request(rid)
        results.append(out)
    return results


def replay_prompt_lookup(
    rec: Recording, curve: VerifyCost, tokens: int = 10, max_ngram: int = 2, stop_ids: Collection[int] = ()
) -> Replayed:
    """Prompt lookup decoding on one recording (transformers' rule, see the module docstring)."""
    if tokens < 1 or max_ngram < 1:
        raise ValueError(f"prompt lookup needs tokens >= 1 and max_ngram >= 1, got {tokens} and {max_ngram}")
    seq = list(rec.prompt)
    out = Replayed(rec.category)
    pos = 0
    while pos < len(rec.output):
        chain = _lookup(seq, tokens, max_ngram)
        chain = chain[: next((i for i, t in enumerate(chain) if t in stop_ids), len(chain))]
        accepted = 0
        while accepted < len(chain) and pos + accepted < len(rec.output) and chain[accepted] == rec.output[pos + accepted]:
            accepted += 1
        emitted = rec.output[pos : pos + accepted + 1]
        seq.extend(emitted)
        pos += len(emitted)
        out.tokens += len(emitted)
        out.rounds += 1
        out.verified += 1 + len(chain)
        out.cost += curve(1 + len(chain))
    return out


def _lookup(seq: list[int], tokens: int, max_ngram: int) -> list[int]:
    """What followed the earliest earlier occurrence of the sequence's last n tokens, for
    n from ``max_ngram`` down to 1 (the first n with a non-empty continuation wins)."""
    end = len(seq)
    for n in range(min(max_ngram, end - 1), 0, -1):
        tail = seq[end - n :]
        for start in range(end - n):
            if seq[start : start + n] == tail:
                return seq[start + n : min(start + n + tokens, end)]
    return []
