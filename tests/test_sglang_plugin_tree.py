"""The Graft worker's pure parts on CPU tensors: tree building, verify input, feedback,
request sync and the radix-cache feed, checked against SGLang 0.5.23's own code.

SGLang's Triton tree kernels run through Triton's CPU interpreter (see conftest.py).
"""

from __future__ import annotations

import logging
from array import array
from types import SimpleNamespace
from typing import Sequence

import pytest
import torch

from helpers import simulate_eagle_draft
from sglang_graft.candidates import Candidates, Source
from sglang_graft.prune import GateConfig
from sglang_graft.sglang.feedback import (
    AcceptanceLog,
    accepted_by_source,
    accepted_mask,
    local_accept_nodes,
    meta_rows,
    target_topk,
)
from sglang_graft.sglang.request_sync import RequestTracker
from sglang_graft.sglang.session import GraftSession
from sglang_graft.sglang.settings import GraftSettings
from sglang_graft.sglang.tree_step import DraftOutputs, TreeBuilder, flatten_draft_steps
from sglang_graft.tree import eagle_candidates

spec_tree = pytest.importorskip("sglang.kernels.ops.speculative.spec_tree")
eagle_utils = pytest.importorskip("sglang.srt.speculative.eagle_utils")

VOCAB = 60
LAYOUT = ("tree_mask", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling", "draft_tokens")


def _draft(builder: TreeBuilder, bs: int, seed: int):
    """Synthetic EAGLE draft outputs, gated level by level as the worker's draft loop does."""
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(bs, builder.topk, builder.num_steps, VOCAB, gen)
    continues = [builder.draft_continues(d + 1, s[d]) for d in range(builder.num_steps - 1)]
    return (s, t, p), DraftOutputs.from_flat(*flatten_draft_steps(s, t, p, continues), topk=builder.topk)


def _sglang_eagle_tree(bonus, s, t, p, seq_lens, topk, steps, n, full: bool):
    """Plain EAGLE's verify tree from SGLang's own code (organize_draft_results + build kernel)."""
    parent_list, top_idx, draft = eagle_utils.organize_draft_results(s, t, p, n)
    bs = len(seq_lens)
    size = int(seq_lens.sum()) * n + n * n * bs if full else n * n * bs
    mask = torch.full((size,), True)
    positions = torch.empty(bs * n, dtype=torch.long)
    ri = torch.full((bs, n), -1, dtype=torch.long)
    rn, rs = ri.clone(), ri.clone()
    mode = spec_tree.TreeMaskMode.FULL_MASK if full else spec_tree.TreeMaskMode.QLEN_ONLY
    spec_tree.sgl_build_tree_kernel_triton(parent_list, top_idx, seq_lens, mask, positions, ri, rn, rs, topk, steps, n, int(mode))
    return mask, positions, ri, rn, rs, torch.cat([bonus.unsqueeze(1), draft], dim=1).flatten()


def test_flattened_draft_outputs_equal_the_core_flattening():
    builder = TreeBuilder(GraftSettings(policy="dense"), num_nodes=8, topk=3, num_steps=4)
    (s, t, p), d = _draft(builder, bs=3, seed=2)
    core = eagle_candidates(s, t, p, 3)
    assert torch.equal(d.candidates.tokens, core.tokens) and torch.equal(d.candidates.parents, core.parents)
    assert torch.equal(d.candidates.scores, core.scores) and torch.equal(d.candidates.depths, core.depths)
    assert d.continues.shape == (3, 3) and bool(d.continues.all())


def test_flatten_handles_a_single_draft_level():
    builder = TreeBuilder(GraftSettings(policy="dense"), num_nodes=3, topk=2, num_steps=1)
    (s, t, p), d = _draft(builder, bs=2, seed=0)
    assert d.candidates.tokens.shape == (2, 2) and d.continues.shape == (2, 0)
    assert torch.equal(d.candidates.parents, torch.full((2, 2), -1))


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize(
    "settings",
    [
        GraftSettings(policy="dense"),
        # Pruning on, but with gates that never fire and no retrieval: still EAGLE's tree.
        GraftSettings(policy="pruned", gates=GateConfig(root_threshold=0.0, depth_thresholds=())),
    ],
    ids=["dense", "pruned-never-gated"],
)
@pytest.mark.parametrize("bs,topk,steps,n", [(1, 2, 3, 6), (3, 4, 3, 8), (2, 8, 4, 24)])
def test_tree_equals_plain_eagle_when_pruning_and_retrieval_are_off(settings, full, bs, topk, steps, n):
    builder = TreeBuilder(settings, num_nodes=n, topk=topk, num_steps=steps)
    (s, t, p), drafts = _draft(builder, bs, seed=bs * 7 + n)
    gen = torch.Generator().manual_seed(n)
    bonus = torch.randint(0, VOCAB, (bs,), generator=gen)
    seq_lens = torch.randint(1, 12, (bs,), generator=gen)
    rids = [f"r{i}" for i in range(bs)]
    out = builder.build(rids, bonus, drafts, seq_lens, "full" if full else "qlen")
    theirs = _sglang_eagle_tree(bonus, s, t, p, seq_lens, topk, steps, n, full)
    for name, a, b in zip(LAYOUT, out.layout, theirs):
        assert torch.equal(a.long(), b.long()), name
    assert bool((out.tree.sources[:, 1:] == int(Source.DRAFT)).all())


def test_gates_prune_drafts_and_keep_exactly_n_nodes():
    settings = GraftSettings(policy="pruned", gates=GateConfig(root_threshold=1.0))
    builder = TreeBuilder(settings, num_nodes=12, topk=3, num_steps=4)
    _, drafts = _draft(builder, bs=2, seed=5)
    assert not bool(drafts.continues[:, 0].any())  # the root gate stops every request at depth 1
    out = builder.build(["a", "b"], torch.tensor([1, 2]), drafts, torch.tensor([5, 9]))
    tree = out.tree
    assert tree.tokens.shape == (2, 12)
    draft = tree.sources == int(Source.DRAFT)
    assert bool((tree.depths[draft] == 1).all()) and int(draft.sum(1).max()) <= 3
    assert bool((tree.sources[:, 1:] != int(Source.ROOT)).all())
    assert out.layout.draft_tokens.shape == (24,)


class ChainRetriever:
    """A stand-in retriever (the scheduler's protocol plus request lifecycle): proposes one
    chain per request, highly scored, spelling ``chains[rid]``."""

    def __init__(self, chains: dict[str, list[int]]) -> None:
        self.chains = chains
        self.observed: list[torch.Tensor] = []
        self.log: list[tuple] = []

    def start_request(self, rid, prompt_ids, namespace=None):
        self.log.append(("start", rid, len(prompt_ids), namespace))

    def append(self, rid, new_token_ids):
        self.log.append(("append", rid, list(new_token_ids)))

    def finish_request(self, rid):
        self.log.append(("finish", rid))

    def propose(self, rids: Sequence[str], budget: int | torch.Tensor) -> Candidates:
        m = max(len(c) for c in self.chains.values())
        bs = len(rids)
        tokens = torch.tensor([self.chains[r] + [0] * (m - len(self.chains[r])) for r in rids])
        cols = torch.arange(m).expand(bs, m)
        return Candidates(
            tokens=tokens,
            parents=(cols - 1).clone(),
            scores=(0.99 - 0.01 * cols).float(),
            sources=torch.full((bs, m), int(Source.CONTEXT)),
            valid=(cols < torch.tensor([len(self.chains[r]) for r in rids]).view(-1, 1))
            & (cols < torch.as_tensor(budget).view(-1, 1)),
        )

    def observe(self, rids, tree_tokens, tree_parents, tree_sources, accepted_mask, target_topk, *, tree_bins=None):
        self.observed.append(accepted_mask.clone())


def _req(rid, prompt, output=(), extra_key=None, cache_salt=None):
    return SimpleNamespace(rid=rid, origin_input_ids=list(prompt), output_ids=array("q", output),
                           extra_key=extra_key, cache_salt=cache_salt)


def test_grafted_chain_deeper_than_the_draft_is_verified_whole_by_sglang():
    """A retrieved chain of n - 1 tokens replaces drafts the gates pruned; SGLang's greedy
    verify kernel accepts all of it, which needs the verify input's deeper
    ``max_tree_depth`` (EAGLE's would stop at ``spec_steps + 1``)."""
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    from sglang_graft.sglang.verify_input import GraftVerifyInput

    n, steps, topk = 8, 2, 2
    chain = [11, 12, 13, 14, 15, 16, 17]
    gates = GateConfig(root_threshold=1.0, min_node_score=1.0)  # prune every draft node
    retriever = ChainRetriever({"a": chain})
    session = GraftSession(GraftSettings(policy="graft", gates=gates), n, topk, steps, retriever)
    rids = session.begin_round([_req("a", [1, 2, 3], [10])])
    _, drafts = _draft(session.builder, bs=1, seed=1)
    out = session.build(rids, torch.tensor([10]), drafts, torch.tensor([4]), "qlen")
    assert out.tree.tokens[0].tolist() == [10] + chain
    assert int(out.tree.depths.max()) == n - 1 > steps
    v = GraftVerifyInput(
        draft_token=out.layout.draft_tokens, custom_mask=out.layout.tree_mask, positions=out.layout.positions,
        retrieve_index=out.layout.retrive_index, retrieve_next_token=out.layout.retrive_next_token,
        retrieve_next_sibling=out.layout.retrive_next_sibling, retrieve_cum_len=None, spec_steps=steps, topk=topk,
        draft_token_num=n, capture_hidden_mode=None, seq_lens_sum=None, seq_lens_cpu=None,
    )
    assert isinstance(v, EagleVerifyInput) and v.is_verify_input()
    assert v.max_tree_depth == n and v.tree_topk == -1 and v.num_tokens_per_req == n
    assert isinstance(GraftVerifyInput.create_idle_input(topk, steps, n, "cpu"), GraftVerifyInput)
    assert out.layout.positions.tolist() == list(range(4, 4 + n))  # seq_len + depth

    # The target agrees with every chain token, then says 99.
    target = torch.tensor([chain + [99]])
    candidates = v.draft_token.view(1, n)
    predicts = torch.zeros(n, dtype=torch.int32)
    accept_index = torch.full((1, v.max_tree_depth), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    spec_tree.verify_tree_greedy_triton(predicts, accept_index, accept_num, candidates, v.retrieve_index,
                                        v.retrieve_next_token, v.retrieve_next_sibling, target)
    assert int(accept_num) == n - 1 and accept_index[0].tolist() == list(range(n))

    rows = session.finish_round(accept_index, torch.randn(n, VOCAB))
    assert rows == [{"draft": 0, "recycling": 0, "context": n - 1, "history": 0, "filler": 0}]
    assert bool(retriever.observed[-1].all())
    with pytest.raises(RuntimeError, match="without a tree built"):
        session.finish_round(accept_index, None)


def _run_rounds(session: GraftSession, rounds: int, seed: int):
    """Rounds of begin/build/finish on a growing batch; the target accepts the first child
    of every node up to depth 2. Returns each round's tree."""
    bs = 3
    outputs = [[7], [8], [9]]
    prompts = [[1, 2, 3, 1, 2], [4, 5, 4, 5, 4], [6, 6, 6]]
    gen = torch.Generator().manual_seed(seed)
    trees = []
    for r in range(rounds):
        reqs = [_req(f"q{i}", prompts[i], outputs[i], extra_key="lora" if i == 2 else None) for i in range(bs)]
        rids = session.begin_round(reqs)
        _, drafts = _draft(session.builder, bs, seed=seed * 100 + r)
        bonus = torch.tensor([o[-1] for o in outputs])
        seq_lens = torch.tensor([len(p) + len(o) for p, o in zip(prompts, outputs)])
        out = session.build(rids, bonus, drafts, seq_lens)
        trees.append(out.tree)
        n = session.num_nodes
        nodes = torch.full((bs, n), -1, dtype=torch.int32)
        nodes[:, 0] = torch.arange(bs) * n
        nxt = out.layout.retrive_next_token
        first = nxt[:, 0]
        nodes[:, 1] = torch.where(first >= 0, first + torch.arange(bs) * n, -1).int()
        session.finish_round(nodes, torch.randn(bs * n, VOCAB, generator=gen))
        for i in range(bs):
            outputs[i] += [int(x) for x in torch.randint(0, VOCAB, (2,), generator=gen)]
    return trees


@pytest.mark.parametrize("policy", ["pruned", "graft"])
def test_two_independent_instances_build_identical_trees(policy):
    """Same inputs, two workers (as on two tensor-parallel ranks): same trees every round,
    while calibration and retrieval state evolve."""
    settings = GraftSettings(policy=policy, gates=GateConfig(mode="online", root_threshold=0.3))

    def session():
        retriever = ChainRetriever({"q0": [5, 6], "q1": [7], "q2": [8, 9, 10]}) if policy == "graft" else None
        return GraftSession(settings, num_nodes=10, topk=3, num_steps=3, retriever=retriever)

    a, b = _run_rounds(session(), 6, seed=3), _run_rounds(session(), 6, seed=3)
    for ta, tb in zip(a, b):
        for field in ("tokens", "parents", "depths", "scores", "sources", "bins"):
            assert torch.equal(getattr(ta, field), getattr(tb, field)), field
    assert any(not torch.equal(a[0].scores, t.scores) for t in a[1:])  # online calibration moved


def test_real_retriever_instances_agree():
    """With the project's Retriever (all three sources; gates that keep only depth 1 of
    the draft, so retrieval gets slots), two sessions build the same trees round after
    round while recycling, context and calibration learn from each verify."""

    def session():
        settings = GraftSettings(policy="graft", gates=GateConfig(root_threshold=1.0))
        s = GraftSession.for_launch(settings, 12, 3, 3, VOCAB)
        assert s.recycling_k == s.retriever.config.recycling_k > 0
        s.retriever.history.insert((None, None), [1, 2, 3, 1, 2, 7, 40, 41, 42])
        return s

    a, b = _run_rounds(session(), 5, seed=4), _run_rounds(session(), 5, seed=4)
    for ta, tb in zip(a, b):
        for field in ("tokens", "parents", "scores", "sources"):
            assert torch.equal(getattr(ta, field), getattr(tb, field)), field
    seen = set(torch.stack([t.sources for t in a]).unique().tolist())
    assert {int(Source.RECYCLING), int(Source.HISTORY)} <= seen


# ---------------------------------------------------------------- feedback


def test_accept_index_maps_to_local_nodes_and_mask():
    n = 5
    accept_index = torch.tensor([[0, 2, 4, -1], [5, 6, -1, -1]], dtype=torch.int32)
    assert local_accept_nodes(accept_index, n).tolist() == [[0, 2, 4, -1], [0, 1, -1, -1]]
    assert accepted_mask(accept_index, n).tolist() == [
        [True, False, True, False, True],
        [True, True, False, False, False],
    ]
    with pytest.raises(ValueError, match=r"outside its request's \[0, 5\) block"):
        local_accept_nodes(torch.tensor([[0, 1], [3, -1]]), n)


def test_target_topk_and_source_counts():
    logits = torch.zeros(2 * 3, 10)
    logits[torch.arange(6), torch.tensor([1, 2, 3, 4, 5, 6])] = 5.0
    logits[torch.arange(6), torch.tensor([9, 9, 9, 0, 0, 0])] = 3.0
    top = target_topk(logits, 2, 3, 2)
    assert top.shape == (2, 3, 2) and top[1, 2].tolist() == [6, 0]
    with pytest.raises(ValueError, match="expected bs\\*n = 2\\*4"):
        target_topk(logits, 2, 4, 2)
    tree = SimpleNamespace(
        batch_size=2, tokens=torch.zeros(2, 4, dtype=torch.long),
        sources=torch.tensor([[0, 1, 3, 4], [0, 2, 1, 5]]),
    )
    acc = torch.tensor([[True, True, True, False], [True, True, False, True]])
    counts = accepted_by_source(tree, acc)
    assert meta_rows(counts) == [
        {"draft": 1, "recycling": 0, "context": 1, "history": 0, "filler": 0},
        {"draft": 0, "recycling": 1, "context": 0, "history": 0, "filler": 1},
    ]


def test_acceptance_log_reports_drafted_and_grafted(caplog):
    log = AcceptanceLog(interval=2)
    counts = torch.tensor([[0, 2, 1, 0, 0, 0], [0, 1, 0, 3, 0, 0]])
    with caplog.at_level(logging.INFO, logger="sglang_graft.sglang.feedback"):
        assert log.add(counts) is None
        line = log.add(counts)
    assert line == "graft: 2 verify rounds, accepted drafted=6 grafted=8 (draft=6, recycling=2, context=6, history=0, filler=0)"
    assert line in caplog.text
    with pytest.raises(ValueError, match="log interval must be >= 0"):
        AcceptanceLog(-1)


# ---------------------------------------------------------------- request sync


def test_request_tracker_feeds_each_token_once_and_frees_absent_requests():
    r = ChainRetriever({})
    tracker = RequestTracker(r)
    assert tracker.sync([_req("a", [1, 2], [3]), _req("b", [4], [], extra_key="k", cache_salt="s")]) == ["a", "b"]
    assert r.log == [("start", "a", 3, (None, None)), ("start", "b", 1, ("k", "s"))]
    r.log.clear()
    tracker.sync([_req("a", [1, 2], [3, 5, 6]), _req("b", [4], [])])
    assert r.log == [("append", "a", [5, 6])]
    r.log.clear()
    tracker.sync([_req("b", [4], [8])])  # "a" finished, aborted or was retracted
    assert r.log == [("finish", "a"), ("append", "b", [8])]
    assert tracker.open_requests == 1
    tracker.close("b")
    tracker.close("b")
    assert r.log[-1] == ("finish", "b") and tracker.open_requests == 0
    tracker.sync([_req("c", [1, 2, 3], [4])])
    with pytest.raises(ValueError, match="shrank from 4 to 3 tokens"):
        tracker.sync([_req("c", [1, 2, 3], [])])


# ---------------------------------------------------------------- radix feed


class _Allocator:
    device = "cpu"

    def free_segment(self, value, start_pos=0):
        pass


def test_history_follows_the_radix_cache():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    from sglang_graft.retrieval import HistoryIndex
    from sglang_graft.sglang import radix_feed

    history = HistoryIndex(vocab_size=VOCAB, max_tokens=1000, ngram=2, max_match=8, max_chain=8, max_occurrences=4)
    feed = radix_feed.install(history)
    try:
        cache = RadixCache.create_simulated(mock_allocator=_Allocator())

        def insert(tokens, extra_key=None, salt=None):
            cache.insert(InsertParams(key=RadixKey(array("q", tokens), extra_key, cache_salt=salt)))

        insert([1, 2, 3, 4, 5])
        assert history.num_sequences == 1 and history.num_tokens == 5
        insert([1, 2, 3, 4, 5, 6, 7])  # extends the first: it replaces it
        assert history.num_sequences == 1 and history.num_tokens == 7
        insert([1, 2, 3])  # inside a cached sequence: redundant
        assert history.num_sequences == 1
        insert([20, 21, 22, 23], extra_key="lora-a")
        insert([20, 21, 22, 30], extra_key="lora-a", salt="user-1")
        assert history.num_sequences == 3 and history.num_namespaces == 3
        probe = array("q", [9, 20, 21])
        found = history.occurrences(("lora-a", None), probe, 3)
        assert [list(o.continuation) for o in found] == [[22, 23]]
        assert [list(o.continuation) for o in history.occurrences(("lora-a", "user-1"), probe, 3)] == [[22, 30]]
        assert history.occurrences((None, None), probe, 3) == []  # never across namespaces

        cache.evict(EvictParams(num_tokens=cache.evictable_size()))
        assert history.num_sequences == 0 and feed.tracked_nodes == 0
        insert([1, 2, 3, 4])
        assert history.num_sequences == 1
        cache.reset()
        assert history.num_sequences == 0
    finally:
        radix_feed.detach()
    insert([5, 6, 7])  # detached: the hooks stay installed and do nothing
    assert history.num_sequences == 0
