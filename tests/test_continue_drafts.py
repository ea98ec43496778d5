"""Context continuations of draft paths (``continue_drafts``).

Retrieval proposes below the root; a draft path that has begun copying an earlier span is
continued from the context below its last node (``ContextIndex.occurrences_after``,
``Retriever.propose_below``) and the tree is re-selected with those nodes
(``graft.graft_below``). Exact on hand-made sequences, and lossless end to end.
"""

from __future__ import annotations

from array import array

import pytest
import torch

from helpers import TEST_DEVICE
from sglang_graft.candidates import Source
from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models
from sglang_graft.graft import graft_below
from sglang_graft.retrieval import ContextIndex, Retriever, RetrieverConfig, match_bin
from sglang_graft.retrieval.context import TokenWindow
from sglang_graft.scheduler import SchedulerConfig
from sglang_graft.tree import TokenTree, depths_from_parents

BLOCK = [10, 11, 12, 13, 14, 15]
PROMPT = [1, 2, *BLOCK, 3, 4, 9]  # the root is 9; the block appeared after "2"


def _ctx(tokens, **kw) -> ContextIndex:
    args = dict(vocab_size=1000, ngram=2, max_match=64, max_chain=8, max_occurrences=4, max_tokens=1 << 20)
    args.update(kw)
    return ContextIndex(array("q", tokens), **args)


def test_occurrences_after_continue_a_path_that_repeats_an_earlier_span():
    idx = _ctx(PROMPT)
    # "9 10 11 12 13" matches "2 10 11 12 13" for 4 tokens; what followed is 14 15 3 4.
    occ = idx.occurrences_after([10, 11, 12, 13], depth=4, min_length=4)
    assert [(o.match_length, list(o.continuation)) for o in occ] == [(4, [14, 15, 3, 4])]
    assert idx.occurrences_after([10, 11, 12, 13], depth=4, min_length=5) == []
    # Nothing is indexed: the current suffix still has no match, and a second call agrees.
    assert idx.occurrences(4) == []
    assert idx.occurrences_after([10, 11, 12, 13], depth=2, min_length=4)[0].continuation.tolist() == [14, 15]


def test_occurrences_after_run_through_the_path_into_a_repeat():
    # "5 6 7 8" then the path "5 6 7 8": the match ends at the real end, so what follows
    # it is the path itself, and then the same period again.
    idx = _ctx([5, 6, 7, 8])
    occ = idx.occurrences_after([5, 6, 7, 8], depth=6, min_length=4)
    assert [(o.match_length, list(o.continuation)) for o in occ] == [(4, [5, 6, 7, 8, 5, 6])]


def test_occurrences_after_need_a_path_and_an_index():
    idx = _ctx(PROMPT)
    assert idx.occurrences_after([], depth=4, min_length=1) == []
    assert idx.occurrences_after([10], depth=0, min_length=1) == []
    assert _ctx([3]).occurrences_after([], depth=3, min_length=1) == []
    assert TokenWindow(array("q", PROMPT), 64).occurrences_after([10, 11, 12, 13], 4, 1) == []


def _tree(tokens, parents, scores, sources) -> TokenTree:
    p = torch.tensor([parents])
    return TokenTree(
        tokens=torch.tensor([tokens]),
        parents=p,
        depths=depths_from_parents(p),
        scores=torch.tensor([scores], dtype=torch.float32),
        sources=torch.tensor([[int(s) for s in sources]]),
        bins=torch.zeros(1, len(tokens), dtype=torch.int64),
    )


D, F = Source.DRAFT, Source.FILLER
# n = 8: the draft path 10 11 12 13, a weak draft sibling 77, and two filler slots.
TREE = _tree(
    [9, 10, 11, 12, 13, 77, 9, 9],
    [-1, 0, 1, 2, 3, 0, 0, 6],
    [1.0, 0.8, 0.6, 0.5, 0.4, 0.1, 0.0, 0.0],
    [Source.ROOT, D, D, D, D, D, F, F],
)


def _context_retriever(**kw) -> Retriever:
    r = Retriever(RetrieverConfig(vocab_size=1000, recycling=False, history=False, **kw))
    r.start_request("a", PROMPT)
    return r


def test_propose_below_hangs_the_continuation_under_the_matching_draft_node():
    r = _context_retriever()
    below = r.propose_below(["a"], TREE, anchors=4)
    assert below is not None
    # Only node 4's path (10 11 12 13) matches for 4 tokens; its continuation may be
    # n - 1 - 4 = 3 deep, hanging under tree position 4 and then its own columns 8, 9.
    assert below.tokens.tolist() == [[14, 15, 3]]
    assert below.parents.tolist() == [[4, 8, 9]]
    assert below.sources.tolist() == [[int(Source.CONTEXT)] * 3]
    rates = r.calibration.step_rates(Source.CONTEXT)
    bins = [match_bin(4, 1.0), match_bin(5, 1.0), match_bin(6, 1.0)]
    assert below.bins.tolist() == [bins]
    expected, score = [], 0.4
    for b in bins:
        score *= rates[b]
        expected.append(score)
    assert below.scores[0].tolist() == pytest.approx(expected)
    assert r.stats()["context"]["proposed"] == 3


def test_propose_below_respects_anchors_min_match_and_disabled_context():
    assert _context_retriever().propose_below(["a"], TREE, anchors=3) is None  # node 4 is the 4th best
    assert _context_retriever(below_min_match=5).propose_below(["a"], TREE, anchors=4) is None
    off = Retriever(RetrieverConfig(vocab_size=1000, context=False, history=False))
    off.start_request("a", PROMPT)
    assert off.propose_below(["a"], TREE, anchors=4) is None
    with pytest.raises(ValueError, match="anchors must be >= 1"):
        _context_retriever().propose_below(["a"], TREE, anchors=0)
    with pytest.raises(ValueError, match="unknown request"):
        _context_retriever().propose_below(["b"], TREE, anchors=4)
    with pytest.raises(ValueError, match="below_min_match must be >= 1"):
        RetrieverConfig(vocab_size=10, below_min_match=0)
    with pytest.raises(ValueError, match="continue_drafts must be >= 0"):
        SchedulerConfig(continue_drafts=-1)
    with pytest.raises(ValueError, match="continue_drafts must be >= 0"):
        EngineConfig(continue_drafts=-1)


def _paths(tree: TokenTree) -> dict[tuple[int, ...], int]:
    """Root-to-node token paths of a tree's real nodes, with each node's source."""
    tokens, parents, sources = (t[0].tolist() for t in (tree.tokens, tree.parents, tree.sources))
    out = {}
    for i in range(1, tree.num_nodes):
        if sources[i] == int(Source.FILLER):
            continue
        path, node = [], i
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        out[tuple(reversed(path))] = sources[i]
    return out


def test_graft_below_keeps_the_best_nodes_of_both_as_one_tree():
    r = _context_retriever()
    below = r.propose_below(["a"], TREE, anchors=4)
    grown = graft_below(TREE, below, num_nodes=8).tree
    grown.validate()
    scores = sorted([0.8, 0.6, 0.5, 0.4, 0.1, *below.scores[0].tolist()], reverse=True)[:7]
    assert sorted(grown.scores[0, 1:].tolist(), reverse=True) == pytest.approx(scores)
    paths = _paths(grown)
    assert paths[(10, 11, 12, 13)] == int(Source.DRAFT)
    assert paths[(10, 11, 12, 13, 14)] == int(Source.CONTEXT)
    assert len(paths) == 7  # the filler slots went to real nodes


def test_graft_below_merges_a_continuation_that_repeats_a_tree_path():
    # The draft already holds 10 11 12 13 14: the continuation's 14 is that node (the
    # draft keeps it, with the better of the two scores) and 15 hangs below it.
    tree = _tree(
        [9, 10, 11, 12, 13, 14, 9, 9],
        [-1, 0, 1, 2, 3, 4, 0, 6],
        [1.0, 0.8, 0.6, 0.5, 0.4, 0.01, 0.0, 0.0],
        [Source.ROOT, D, D, D, D, D, F, F],
    )
    below = _context_retriever().propose_below(["a"], tree, anchors=4)
    result = graft_below(tree, below, num_nodes=8)
    paths = _paths(result.tree)
    assert paths[(10, 11, 12, 13, 14)] == int(Source.DRAFT)
    assert paths[(10, 11, 12, 13, 14, 15)] == int(Source.CONTEXT)
    assert result.num_merged.tolist() == [1]


@pytest.mark.parametrize("anchors", [0, 4])
def test_graft_with_draft_continuations_is_lossless(anchors, monkeypatch):
    """Greedy graft output equals plain decoding with continuations on and off, and the
    continuations do reach the tree (a short minimum match, so tiny models trigger it)."""
    torch.set_num_threads(1)
    target, draft = (m.to(TEST_DEVICE) for m in tiny_models("qwen2", vocab_size=120, seed=4, hidden=32))
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [9, 1, 9, 2, 9, 1, 9, 2, 9], [3, 4]]
    ref = SpecEngine(target, None, EngineConfig(policy="ar")).generate(prompts, 30)
    grafted = []
    original = Retriever.propose_below

    def spy(self, rids, tree, k):
        below = original(self, rids, tree, k)
        grafted.append(0 if below is None else int(below.valid.sum()))
        return below

    monkeypatch.setattr(Retriever, "propose_below", spy)
    retriever = Retriever(RetrieverConfig(vocab_size=120, below_min_match=2, device=str(TEST_DEVICE)))
    config = EngineConfig(
        policy="graft", num_nodes=8, draft_depth=3, draft_topk=2, draft_cost_ratio=0.01, continue_drafts=anchors
    )
    out = SpecEngine(target, draft, config, retriever=retriever).generate(prompts, 30)
    assert [r.token_ids for r in out.requests] == [r.token_ids for r in ref.requests]
    if anchors:
        assert sum(grafted) > 0, "no draft path was ever continued"
    else:
        assert grafted == []
