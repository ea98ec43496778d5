"""Turn matched occurrences into a small scored subtree of continuations.

The context and history indexes both answer the same question: "where did the current
suffix occur before, how long was the match, and what followed?". Several occurrences
often agree for a while and then diverge; merging their continuations into a trie keeps
one node per distinct path, counts how many occurrences support each node, and scores it
by the calibrated step rate of its (effective match length, agreement share) bin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sglang_graft.retrieval.scoring import match_bin


class Occurrence(NamedTuple):
    """One earlier place where the current suffix appeared."""

    match_length: int  # tokens of the current suffix that match there (capped)
    continuation: Sequence[int]  # the tokens that followed it, nearest first


class HostProposal(NamedTuple):
    """A scored forest over the root, best first (so every parent precedes its children)."""

    tokens: list[int]
    parents: list[int]  # -1: child of the root, else an earlier index in this proposal
    scores: list[float]
    bins: list[int]


EMPTY_PROPOSAL = HostProposal([], [], [], [])


def continuation_tree(occurrences: Sequence[Occurrence], budget: int, step_rates: Sequence[float]) -> HostProposal:
    """Merge continuations into a trie and keep its ``budget`` best nodes.

    A node's effective match length is the longest supporting match plus its depth minus
    one (an accepted path extends the match); its share is how many supporting
    occurrences reach it over how many reach its parent. Its score is its parent's times
    ``step_rates[bin]``. Ties keep creation order, which is topological, so the selection
    is ancestor-closed.
    """
    if budget <= 0 or not occurrences:
        return EMPTY_PROPOSAL
    tokens: list[int] = []
    parents: list[int] = []
    support: list[int] = []
    longest: list[int] = []
    depths: list[int] = []
    child_of: dict[int, int] = {}  # (parent + 1) << 32 | token  ->  node
    for occ in occurrences:
        parent = -1
        for depth, token in enumerate(occ.continuation[:budget], start=1):
            key = ((parent + 1) << 32) | token
            node = child_of.get(key)
            if node is None:
                node = len(tokens)
                child_of[key] = node
                tokens.append(token)
                parents.append(parent)
                support.append(0)
                longest.append(0)
                depths.append(depth)
            support[node] += 1
            if occ.match_length > longest[node]:
                longest[node] = occ.match_length
            parent = node

    total = len(occurrences)
    scores: list[float] = []
    bins: list[int] = []
    for node, parent in enumerate(parents):
        above = total if parent < 0 else support[parent]
        b = match_bin(longest[node] + depths[node] - 1, support[node] / above)
        bins.append(b)
        scores.append(step_rates[b] * (1.0 if parent < 0 else scores[parent]))

    # Best first; ``sorted`` is stable even reversed, so ties keep creation order.
    order = sorted(range(len(tokens)), key=scores.__getitem__, reverse=True)[:budget]
    new_index = {old: new for new, old in enumerate(order)}
    return HostProposal(
        tokens=[tokens[i] for i in order],
        parents=[new_index[parents[i]] if parents[i] >= 0 else -1 for i in order],
        scores=[scores[i] for i in order],
        bins=[bins[i] for i in order],
    )
