"""The three retrieval sources on their own: recycling table, context index, history index."""

from __future__ import annotations

import heapq
import math
import random
from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.candidates import Source
from sglang_graft.retrieval import (
    ContextIndex,
    HistoryIndex,
    Occurrence,
    RecyclingTable,
    continuation_tree,
    match_bin,
    rank_template,
    rounded_rates,
)

# ----------------------------------------------------------------------------- recycling


def _table(vocab: int, k: int, rows: dict[int, list[int]], **kw) -> RecyclingTable:
    t = RecyclingTable(vocab, k, **kw)
    keys = list(rows)
    t.update(torch.tensor([keys]), torch.tensor([[rows[key] for key in keys]]))
    return t


def test_recycling_update_and_empty_rows():
    t = _table(10, 3, {1: [2, 3, 4], 5: [6, 7, 8]})
    assert t.successors(torch.tensor([1, 5, 0])).tolist() == [[2, 3, 4], [6, 7, 8], [-1, -1, -1]]
    assert t.memory_bytes() == (10 + 2) * 3 * 4


def test_recycling_last_write_wins_later_column_then_later_request():
    t = RecyclingTable(10, 2)
    tokens = torch.tensor([[1, 1, 2], [2, 3, 1]])
    topk = torch.tensor([[[4, 5], [6, 7], [8, 9]], [[0, 1], [2, 3], [5, 4]]])
    t.update(tokens, topk)
    # token 1: row 0 col 0, row 0 col 1, row 1 col 2 -> the last (row 1) wins.
    # token 2: row 0 col 2, then row 1 col 0 -> row 1 wins.
    assert t.successors(torch.tensor([1, 2, 3])).tolist() == [[5, 4], [0, 1], [2, 3]]
    t2 = RecyclingTable(10, 2)
    t2.update(torch.tensor([[1, 1]]), torch.tensor([[[4, 5], [6, 7]]]))
    assert t2.successors(torch.tensor([1])).tolist() == [[6, 7]]


def test_recycling_valid_mask_short_and_long_topk_and_logits():
    t = RecyclingTable(10, 3)
    t.update(torch.tensor([[1, -5]]), torch.tensor([[[4, 5], [6, 7]]]), valid=torch.tensor([[True, False]]))
    assert t.successors(torch.tensor([1, 2])).tolist() == [[4, 5, -1], [-1, -1, -1]]
    t.update(torch.tensor([[2]]), torch.tensor([[[9, 8, 7, 6, 5]]]))
    assert t.successors(torch.tensor([2])).tolist() == [[9, 8, 7]]
    logits = torch.zeros(1, 1, 10)
    logits[0, 0, [3, 8, 1]] = torch.tensor([3.0, 2.0, 1.0])
    t.update(torch.tensor([[4]]), logits=logits)
    assert t.successors(torch.tensor([4])).tolist() == [[3, 8, 1]]


def test_recycling_rejects_bad_ids():
    t = RecyclingTable(10, 2)
    with pytest.raises(ValueError, match="negative token id -1"):
        t.update(torch.tensor([[-1]]), torch.tensor([[[1, 2]]]))
    with pytest.raises(ValueError, match="token id 10, outside the vocabulary"):
        t.update(torch.tensor([[1]]), torch.tensor([[[1, 10]]]))
    with pytest.raises(ValueError, match="exactly one of topk_ids and logits"):
        t.update(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="token id 12"):
        t.propose(torch.tensor([12]), [0.5, 0.2], 3)
    with pytest.raises(ValueError, match="budget must be >= 0 nodes per request, got -2"):
        t.propose(torch.tensor([1]), [0.5, 0.2], -2)
    with pytest.raises(ValueError, match="rank_rates must have k=2"):
        t.propose(torch.tensor([1]), [0.5], 2)
    with pytest.raises(ValueError, match=r"rank_rates must be probabilities in \[0, 1\], got \[0.5, 1.5\]"):
        t.propose(torch.tensor([1]), [0.5, 1.5], 2)
    with pytest.raises(ValueError, match="vocab_size"):
        RecyclingTable(0)


def test_recycling_best_first_exact():
    # root 0 -> [1, 2]; 1 -> [3, 4]; 3 -> [5, 6]; 2 unknown below.
    t = _table(10, 2, {0: [1, 2], 1: [3, 4], 3: [5, 6]}, max_nodes=16, max_depth=3)
    c = t.propose(torch.tensor([0]), [0.8, 0.3], 4)
    c.validate(10)
    assert c.tokens.tolist() == [[1, 3, 5, 2]]
    assert c.parents.tolist() == [[-1, 0, 1, -1]]
    assert c.bins.tolist() == [[0, 0, 0, 1]]
    assert c.sources.tolist() == [[int(Source.RECYCLING)] * 4]
    q, q1 = rounded_rates([0.8, 0.3])
    assert c.scores[0].tolist() == pytest.approx([q, q * q, q * q * q, q1])


def test_recycling_shape_follows_the_table():
    # Same rates, but the top-1 successor's row is unknown: the budget goes to rank-1's subtree.
    t = _table(10, 2, {0: [1, 2], 2: [7, 8]}, max_nodes=16, max_depth=3)
    c = t.propose(torch.tensor([0]), [0.8, 0.3], 3)
    assert c.tokens.tolist() == [[1, 2, 7]]
    assert c.parents.tolist() == [[-1, -1, 1]]
    q0, q1 = rounded_rates([0.8, 0.3])
    assert c.scores[0].tolist() == pytest.approx([q0, q1, q1 * q0])


def test_recycling_budget_tensor_and_unknown_root():
    t = _table(10, 2, {0: [1, 2]})
    c = t.propose(torch.tensor([0, 9, 0]), [0.5, 0.2], torch.tensor([2, 2, 0]))
    assert c.valid.sum(dim=1).tolist() == [2, 0, 0]


def _oracle_best_first(table: dict[int, list[int]], root: int, rates: list[float], depth: int) -> list[float]:
    """Scores of every existing node up to ``depth``, best first (plain priority queue)."""
    out, queue = [], [(-1.0, root, 0)]
    while queue:
        neg, tok, d = heapq.heappop(queue)
        if d > 0:
            out.append(-neg)
        if d < depth:
            for r, child in enumerate(table.get(tok, [])):
                heapq.heappush(queue, (neg * rates[r], child, d + 1))
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rates=st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3),
    budget=st.integers(1, 12),
)
def test_recycling_matches_a_priority_queue(seed, rates, budget):
    rng = random.Random(seed)
    vocab, depth = 12, 3
    rows = {tok: rng.sample(range(vocab), 3) for tok in range(vocab) if rng.random() < 0.6}
    t = RecyclingTable(vocab, 3, max_nodes=3 + 9 + 27, max_depth=depth)  # the whole rank tree
    if rows:
        keys = list(rows)
        t.update(torch.tensor([keys]), torch.tensor([[rows[key] for key in keys]]))
    c = t.propose(torch.tensor([0]), rates, budget)
    c.validate(vocab)
    n = int(c.valid.sum())
    expected = _oracle_best_first(rows, 0, rounded_rates(rates), depth)[:budget]
    assert c.scores[0, :n].tolist() == pytest.approx(expected, rel=1e-5)
    # Every node really is the parent's successor at its rank, and scores never rise.
    succ = t.successors(torch.arange(vocab)).tolist()
    for i in range(n):
        p = int(c.parents[0, i])
        ptok = 0 if p < 0 else int(c.tokens[0, p])
        assert succ[ptok][int(c.bins[0, i])] == int(c.tokens[0, i])
        if p >= 0:
            assert float(c.scores[0, i]) <= float(c.scores[0, p])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    width=st.integers(1, 5),
    rates=st.lists(st.sampled_from([0.05, 0.1, 0.3, 0.5, 0.9]), min_size=3, max_size=3),
    limit=st.integers(1, 14),
)
def test_host_loops_match_the_tensor_recycling_table(seed, width, rates, limit):
    """``write_rows`` and ``best_existing`` (host loops) against ``write`` and ``propose``
    (tensor ops), with short and long top-k rows, duplicate tokens and tied rates."""
    rng = random.Random(seed)
    vocab = 9
    by_tensor, by_host = (RecyclingTable(vocab, 3, max_nodes=20, max_depth=3) for _ in range(2))
    for _ in range(3):
        tokens = torch.tensor([[rng.randrange(vocab) for _ in range(5)] for _ in range(2)])
        ids = torch.tensor([[[rng.randrange(vocab) for _ in range(width)] for _ in range(5)] for _ in range(2)])
        by_tensor.update(tokens, ids)
        by_host.write_rows(tokens.view(-1).tolist(), array("i", ids.view(-1).tolist()), width)
    everything = torch.arange(vocab)
    assert torch.equal(by_host.successors(everything), by_tensor.successors(everything))
    roots = list(range(vocab))
    want = by_tensor.propose(torch.tensor(roots), rates, limit)
    picks = by_host.best_existing(roots, rates, limit)
    for b, (nodes, tokens) in enumerate(zip(picks.nodes, picks.tokens)):
        n = int(want.valid[b].sum())
        assert tokens == want.tokens[b, :n].tolist()
        assert [picks.scores[j] for j in nodes] == want.scores[b, :n].tolist()
        assert [picks.ranks[j] for j in nodes] == want.bins[b, :n].tolist()
        position = {node: i for i, node in enumerate(nodes)}
        parents = [position[picks.parents[j]] if picks.parents[j] >= 0 else -1 for j in nodes]
        assert parents == want.parents[b, :n].tolist()


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8))
def test_rounded_rates_stay_within_half_a_step(rates):
    for r, q in zip(rates, rounded_rates(rates)):
        assert 0.0 < q <= 1.0
        assert abs(math.log(q) - math.log(max(r, 1e-6))) <= 0.5 / 32 + 1e-12


@settings(max_examples=30, deadline=None)
@given(
    base=st.lists(st.floats(0.02, 1.0), min_size=2, max_size=2),
    moves=st.lists(st.lists(st.floats(-0.04, 0.04), min_size=2, max_size=2), min_size=1, max_size=12),
)
def test_reused_templates_follow_the_rounded_rates_exactly(base, moves):
    """Rates drifting by a few percent per round (so the template is sometimes reused,
    sometimes rebuilt): every proposal is scored by exactly the rounded rates of the last
    rebuild, which happens when a rate has moved a whole step (1/32 of its log) away from
    them, and at the rates of that round, rounded."""
    t = _table(10, 2, {0: [1, 2], 1: [3, 4], 2: [5, 6], 3: [7, 8]}, max_nodes=6, max_depth=2)
    rates = list(base)
    built: list[float] | None = None
    for move in moves:
        rates = [min(1.0, max(0.01, r * (1 + m))) for r, m in zip(rates, move)]
        # (The band's edge is narrowed by 1e-6 of a step, far above rounding error.)
        if built is None or any(abs(math.log(r / q)) * 32 >= 1.0 - 1e-6 for r, q in zip(rates, built)):
            built = rounded_rates(rates)
        assert all(abs(math.log(r / q)) * 32 < 1.0 for r, q in zip(rates, built))
        c = t.propose(torch.tensor([0]), rates, 6)
        q0, q1 = built
        want = sorted([q0, q1, q0 * q0, q0 * q1, q1 * q0, q1 * q1], reverse=True)
        assert c.scores[0].tolist() == pytest.approx(want, rel=1e-6)


def test_template_is_kept_within_a_step_and_rebuilt_beyond_it():
    """A rate 0.7 steps above its rounded rate keeps the template (plain rounding would
    have moved it a step); 1.2 steps above rebuilds it at the new rounded rate."""
    t = _table(10, 2, {0: [1, 2]}, max_nodes=2, max_depth=1)
    q = rounded_rates([0.5])[0]
    step = math.exp(1 / 32)

    def first_score(rate: float) -> float:
        return t.propose(torch.tensor([0]), [rate, 0.1], 1).scores[0, 0].item()

    assert first_score(q) == pytest.approx(q, rel=1e-6)
    assert first_score(q * step**0.7) == pytest.approx(q, rel=1e-6)
    assert first_score(q / step**0.7) == pytest.approx(q, rel=1e-6)
    assert first_score(q * step**1.2) == pytest.approx(q * step, rel=1e-6)


def test_rank_template_is_best_first_and_topological():
    t = rank_template([0.6, 0.3, 0.1], max_nodes=10, max_depth=4)
    scores = t.scores
    assert len(t.parents) == 10
    assert all(p < i for i, p in enumerate(t.parents))
    # The 10 best rank paths: 0.6, 0.36, 0.3, 0.216, 0.18 (x2), 0.1296, 0.108 (x3).
    assert sorted(scores, reverse=True) == pytest.approx(
        [0.6, 0.36, 0.3, 0.216, 0.18, 0.18, 0.1296, 0.108, 0.108, 0.108]
    )


# ----------------------------------------------------------------------------- continuations


def test_continuation_tree_counts_and_merges():
    rates = [0.5] * 36
    occ = [Occurrence(4, [7, 8, 9]), Occurrence(4, [7, 8, 1]), Occurrence(2, [3])]
    p = continuation_tree(occ, budget=10, step_rates=rates)
    # 7 and 8 are shared by two of three occurrences; 9, 1 each by one of two.
    assert p.tokens == [7, 3, 8, 9, 1]
    assert p.parents == [-1, -1, 0, 2, 2]
    assert p.bins[0] == match_bin(4, 2 / 3) and p.bins[1] == match_bin(2, 1 / 3)
    assert p.bins[2] == match_bin(5, 1.0) and p.bins[3] == match_bin(6, 0.5)
    assert continuation_tree(occ, budget=0, step_rates=rates).tokens == []
    assert continuation_tree(occ, budget=2, step_rates=rates).tokens == [7, 3]


# ----------------------------------------------------------------------------- context


def _ctx(tokens, **kw) -> ContextIndex:
    args = dict(vocab_size=1000, ngram=2, max_match=64, max_chain=8, max_occurrences=4, max_tokens=1 << 20)
    args.update(kw)
    return ContextIndex(array("q", tokens), **args)


def test_context_repeated_code_block():
    block = [10, 11, 12, 13, 14, 15, 16, 17]
    idx = _ctx([1, 2] + block + [3, 4] + block[:3])
    occ = idx.occurrences(8)
    assert len(occ) == 1
    # The suffix "10 11 12" matches the first block for 3 tokens (before it: 2 vs 4).
    assert occ[0].match_length == 3
    assert list(occ[0].continuation) == [13, 14, 15, 16, 17, 3, 4, 10]


def test_context_periodic_continuation():
    idx = _ctx([5, 1, 2, 1, 2, 1, 2])
    occ = idx.occurrences(5)
    assert list(occ[0].continuation) == [1, 2, 1, 2, 1]
    assert occ[0].match_length == 4  # "1 2 1 2" also ends two tokens earlier


def test_context_divergent_occurrences_become_branches():
    idx = _ctx([5, 6, 7, 1, 5, 6, 8, 2, 5, 6])
    occ = idx.occurrences(4)
    assert [list(o.continuation)[:2] for o in occ] == [[8, 2], [7, 1]]  # equal length: latest first
    p = continuation_tree(occ, 4, [0.5] * 36)
    assert p.tokens == [8, 7, 2, 1]
    assert p.parents == [-1, -1, 0, 1]


def test_context_longer_match_ranks_first():
    # "3 4" occurs after "9 2" (matches "2 3 4" -> 3) and after "7 7" (2 tokens only).
    idx = _ctx([9, 2, 3, 4, 50, 7, 7, 3, 4, 60, 1, 2, 3, 4])
    occ = idx.occurrences(1)
    assert [(o.match_length, list(o.continuation)) for o in occ] == [(3, [50]), (2, [60])]


def test_context_prompt_quoted_back_and_carried_long_match():
    quote = [100, 101, 102, 7, 8, 103, 104, 105]
    noise = [7, 8, 200] * 12  # makes the bigram "7 8" busier than max_chain
    idx = _ctx(quote + noise, max_chain=4)
    idx.extend(array("q", [100, 101, 102]))
    assert list(idx.occurrences(3)[0].continuation) == [7, 8, 103]
    idx.extend(array("q", [7, 8]))
    occ = idx.occurrences(3)
    assert occ[0].match_length == 5
    assert list(occ[0].continuation) == [103, 104, 105]
    # A fresh index over the same tokens cannot reach the quote through the busy chain.
    fresh = _ctx(quote + noise + [100, 101, 102, 7, 8], max_chain=4)
    assert list(fresh.occurrences(3)[0].continuation) != [103, 104, 105]


def test_context_no_match_and_short_context():
    assert _ctx([1, 2, 3, 4]).occurrences(4) == []
    assert _ctx([1]).occurrences(4) == []
    with pytest.raises(ValueError, match="at least one token"):
        _ctx([])


def test_context_window_bound():
    idx = _ctx([1, 2], max_tokens=64)
    rng = random.Random(0)
    for _ in range(500):
        idx.extend(array("q", [rng.randrange(50) for _ in range(rng.randrange(1, 6))]))
        assert len(idx.tokens) <= 64
        assert len(idx._prev) == len(idx.tokens)
        assert all(0 <= pos < len(idx.tokens) for pos in idx._head.values())
    # Still finds matches after trimming: repeat the last 6 tokens' first half.
    tail = list(idx.tokens[-6:])
    idx.extend(array("q", tail[:3]))
    assert list(idx.occurrences(3)[0].continuation)[:3] == tail[3:6]


# ----------------------------------------------------------------------------- history


def _hist(**kw) -> HistoryIndex:
    args = dict(vocab_size=1000, max_tokens=1000, ngram=3, max_match=64, max_chain=8, max_occurrences=4)
    args.update(kw)
    return HistoryIndex(**args)


def _cont(h: HistoryIndex, namespace, suffix, depth=4) -> list[list[int]]:
    return [list(o.continuation) for o in h.occurrences(namespace, array("q", suffix), depth)]


def test_history_lookup_and_namespace_isolation():
    h = _hist()
    h.insert(None, [1, 2, 3, 4, 5, 6, 7])
    h.insert("lora-a", [1, 2, 3, 4, 9, 9, 9])
    assert _cont(h, None, [50, 3, 4, 5]) == [[6, 7]]
    assert _cont(h, None, [2, 3, 4]) == [[5, 6, 7]]
    assert _cont(h, "lora-a", [2, 3, 4]) == [[9, 9, 9]]
    assert _cont(h, "lora-b", [2, 3, 4]) == []
    assert _cont(h, ("lora", 7), [2, 3, 4]) == []
    assert h.num_namespaces == 2 and h.num_tokens == 14


def test_history_longest_match_first():
    h = _hist()
    h.insert(None, [1, 2, 3, 4, 50])  # matches the suffix "1 2 3 4" whole: first, though older
    h.insert(None, [8, 2, 3, 4, 40])  # matches 3 tokens only
    assert _cont(h, None, [1, 2, 3, 4], depth=1) == [[50], [40]]


def test_history_lru_eviction_and_reinsert_refresh():
    h = _hist(max_tokens=20)
    a = h.insert(None, list(range(10, 20)))
    b = h.insert(None, list(range(20, 30)))
    assert h.insert(None, list(range(10, 20))) == a  # refresh, no copy
    c = h.insert(None, list(range(30, 40)))
    assert h.num_tokens == 20 and h.num_evicted == 1
    assert _cont(h, None, [21, 22, 23]) == []  # b went (least recently used)
    assert _cont(h, None, [11, 12, 13]) == [[14, 15, 16, 17]]
    assert len({a, b, c}) == 3


def test_history_use_counts_for_lru():
    h = _hist(max_tokens=20)
    h.insert(None, list(range(10, 20)))
    h.insert(None, list(range(20, 30)))
    assert _cont(h, None, [11, 12, 13]) == [[14, 15, 16, 17]]  # touches the first
    h.insert(None, list(range(30, 40)))
    assert _cont(h, None, [11, 12, 13]) != [] and _cont(h, None, [21, 22, 23]) == []


def test_history_evict_by_handle_or_tokens_hands_chain_heads_on():
    h = _hist()
    old = h.insert(None, [1, 2, 3, 4, 5])
    new = h.insert(None, [7, 2, 3, 4, 6])
    assert _cont(h, None, [2, 3, 4], 1) == [[6], [5]]
    assert h.evict(None, new) is True
    assert _cont(h, None, [2, 3, 4], 1) == [[5]]
    assert h.evict(None, new) is False
    assert h.evict(None, [1, 2, 3, 4, 5]) is True
    assert _cont(h, None, [2, 3, 4], 1) == [] and h.num_tokens == 0 and h.num_namespaces == 0
    assert h.evict(None, [1, 2, 3]) is False
    h2 = _hist()
    handle = h2.insert("a", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="belongs to namespace 'a'"):
        h2.evict("b", handle)
    assert old != new


def test_history_bad_input():
    h = _hist()
    with pytest.raises(ValueError, match="empty"):
        h.insert(None, [])
    with pytest.raises(ValueError, match="negative token id -3"):
        h.insert(None, [1, -3])
    with pytest.raises(ValueError, match="token id 1000, outside"):
        h.insert(None, torch.tensor([1, 1000]))
    with pytest.raises(ValueError, match="hashable"):
        h.insert(["not", "hashable"], [1, 2])
    with pytest.raises(ValueError, match="max_tokens"):
        _hist(max_tokens=0)
    assert h.num_namespaces == 0


def test_history_oversized_sequence_keeps_its_tail():
    h = _hist(max_tokens=8)
    h.insert(None, list(range(100, 120)))
    assert h.num_tokens == 8
    assert _cont(h, None, [113, 114, 115]) == [[116, 117, 118, 119]]
    assert h.evict(None, list(range(100, 120))) is True


def _check_history_invariants(h: HistoryIndex) -> None:
    assert h.num_tokens <= h.max_tokens
    assert h.num_tokens == sum(len(s.tokens) for s in h._sequences.values())
    for ns, space in h._namespaces.items():
        assert space.num_sequences == len(space.by_digest) > 0
        assert len(space.head) <= h.num_tokens
        for link in space.head.values():  # every chain head points into a live sequence of ns
            seq = h._sequences[link >> 32]
            assert seq.namespace == ns and (link & 0xFFFFFFFF) < len(seq.tokens)


def test_history_memory_bound_under_a_long_random_stream():
    rng = random.Random(1)
    h = _hist(max_tokens=500, vocab_size=20)
    handles = []
    for step in range(1500):
        op = rng.random()
        ns = rng.choice([None, "a", "b"])
        if op < 0.7:
            seq = [rng.randrange(20) for _ in range(rng.randrange(1, 60))]
            handles.append((h.insert(ns, seq), ns))
        elif op < 0.85 and handles:
            handle, hns = handles[rng.randrange(len(handles))]
            if handle in h._sequences:
                h.evict(hns, handle)
        else:
            for o in h.occurrences(ns, array("q", [rng.randrange(20) for _ in range(4)]), 5):
                assert 1 <= len(o.continuation) <= 5
        if step % 25 == 0:
            _check_history_invariants(h)
    _check_history_invariants(h)
    assert h.num_evicted > 0
    assert 0 < h.memory_bytes() < 200_000
