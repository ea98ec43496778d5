"""Pruning, grafting and calibration."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import simulate_eagle_draft
from sglang_graft.calibration import AcceptanceCalibrator, confidence_bins
from sglang_graft.candidates import Candidates, Source
from sglang_graft.graft import graft, source_counts, summarise_paths, trim
from sglang_graft.prune import ConfidencePruner, GateConfig, stop_depths
from sglang_graft.tree import ancestor_mask, build_eagle_tree, eagle_candidates, pack, tree_from_selection


def _chain(tokens: list[list[int]], scores: list[list[float]], source: Source, valid=None) -> Candidates:
    """One root-hung chain per request."""
    t = torch.tensor(tokens)
    bs, m = t.shape
    parents = (torch.arange(m) - 1).expand(bs, m).clone()
    return Candidates(
        tokens=t,
        parents=parents,
        scores=torch.tensor(scores),
        sources=torch.full((bs, m), int(source)),
        valid=torch.ones(bs, m, dtype=torch.bool) if valid is None else torch.tensor(valid),
    )


def _paths(tree, b):
    """Root-to-node token paths of request b, as tuples, one per node."""
    out = []
    for i in range(tree.num_nodes):
        path, cur = [], i
        while cur > 0:
            path.append(int(tree.tokens[b, cur]))
            cur = int(tree.parents[b, cur])
        out.append(tuple(reversed(path)))
    return out


def test_retrieved_chain_merges_into_draft_path_and_continues_it():
    # Draft: root -> 5 (0.9) -> 6 (0.5). Retrieval chain 5, 6, 7, 8 with scores 0.8 .. 0.4.
    drafts = _chain([[5, 6]], [[0.9, 0.5]], Source.DRAFT)
    retrieved = _chain([[5, 6, 7, 8]], [[0.8, 0.7, 0.6, 0.4]], Source.CONTEXT)
    tree, merged = graft(torch.tensor([1]), [drafts, retrieved], num_nodes=5)
    tree.validate()
    assert merged.tolist() == [2]
    assert tree.tokens[0].tolist() == [1, 5, 6, 7, 8]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3]
    # Merged nodes keep the draft's source and the best score of the pair.
    assert tree.sources[0].tolist() == [Source.ROOT, Source.DRAFT, Source.DRAFT, Source.CONTEXT, Source.CONTEXT]
    assert torch.allclose(tree.scores[0], torch.tensor([1.0, 0.9, 0.7, 0.6, 0.4]))


def test_graft_fills_only_freed_slots_best_first():
    drafts = _chain([[5, 6, 9]], [[0.9, 0.5, 0.01]], Source.DRAFT, valid=[[True, True, False]])
    retrieved = Candidates(
        tokens=torch.tensor([[7, 8, 3]]),
        parents=torch.tensor([[-1, 0, -1]]),
        scores=torch.tensor([[0.6, 0.55, 0.2]]),
        sources=torch.full((1, 3), int(Source.RECYCLING)),
        valid=torch.ones(1, 3, dtype=torch.bool),
    )
    tree, _ = graft(torch.tensor([1]), [drafts, retrieved], num_nodes=5)
    # 4 slots: draft 5 (.9), retrieved 7 (.6), 8 (.55), draft 6 (.5); 3 (.2) and the invalid 9 lose.
    assert sorted(_paths(tree, 0)[1:]) == sorted([(5,), (5, 6), (7,), (7, 8)])
    assert source_counts(tree)[0, Source.DRAFT] == 2 and source_counts(tree)[0, Source.RECYCLING] == 2


def test_graft_uses_filler_only_when_dry_and_counts_it():
    tree, merged = graft(torch.tensor([4, 9]), [Candidates.empty(2)], num_nodes=4)
    tree.validate()
    assert (tree.sources[:, 1:] == int(Source.FILLER)).all()
    assert source_counts(tree)[:, Source.FILLER].tolist() == [3, 3]
    assert tree.tokens.tolist() == [[4, 4, 4, 4], [9, 9, 9, 9]]
    assert merged.tolist() == [0, 0]
    one = _chain([[2]], [[0.3]], Source.HISTORY)
    tree, _ = graft(torch.tensor([4]), [one], num_nodes=4)
    assert source_counts(tree)[0, Source.FILLER] == 2 and source_counts(tree)[0, Source.HISTORY] == 1


def _random_candidates(bs: int, m: int, vocab: int, gen: torch.Generator, source: Source) -> Candidates:
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, m)]) for _ in range(bs)])
    raw = torch.rand(bs, m, generator=gen)
    # Scores must not increase down a path: multiply along it (products of probabilities).
    scores = raw.clone()
    for i in range(m):
        p = parents[:, i]
        scores[:, i] = torch.where(p >= 0, scores.gather(1, p.clamp(min=0).view(-1, 1)).squeeze(1) * raw[:, i], raw[:, i])
    return Candidates(
        tokens=torch.randint(0, vocab, (bs, m), generator=gen),
        parents=parents,
        scores=scores,
        sources=torch.full((bs, m), int(source)),
        valid=torch.rand(bs, m, generator=gen) > 0.15,
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(2, 20), st.integers(0, 30), st.integers(0, 30), st.integers(0, 2**31 - 1))
def test_graft_properties(bs, n, m_draft, m_retr, seed):
    gen = torch.Generator().manual_seed(seed)
    drafts = _random_candidates(bs, m_draft, 6, gen, Source.DRAFT) if m_draft else Candidates.empty(bs)
    retr = _random_candidates(bs, m_retr, 6, gen, Source.CONTEXT) if m_retr else Candidates.empty(bs)
    roots = torch.randint(0, 6, (bs,), generator=gen)
    tree, _ = graft(roots, [drafts, retr], num_nodes=n)
    tree.validate(vocab_size=6)
    assert tree.tokens.shape == (bs, n)  # exactly n nodes, always
    assert torch.equal(tree.tokens[:, 0], roots)
    for b in range(bs):
        paths = _paths(tree, b)
        real = [p for p, s in zip(paths, tree.sources[b].tolist()) if s != Source.FILLER]
        assert len(set(real)) == len(real), "duplicate root paths must be merged"
        # Scores never increase from parent to child.
        for i in range(1, n):
            assert float(tree.scores[b, i]) <= float(tree.scores[b, int(tree.parents[b, i])]) + 1e-6
    # Same inputs, same tree (deterministic tie-breaks).
    again, _ = graft(roots, [drafts, retr], num_nodes=n)
    for name in ("tokens", "parents", "depths", "scores", "sources", "bins"):
        assert torch.equal(getattr(tree, name), getattr(again, name)), name


def _scored_paths(tree, b):
    """Root path -> score of request b's proposed nodes (the root and fillers left out)."""
    nodes = zip(_paths(tree, b), tree.scores[b].tolist(), tree.sources[b].tolist())
    return {path: score for path, score, src in nodes if path and src != Source.FILLER}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(3, 20), st.integers(0, 30), st.integers(0, 2**31 - 1), st.data())
def test_trim_keeps_the_best_nodes_as_a_tree(bs, n, m, seed, data):
    """``trim`` to width w keeps, per request, the real nodes of the w - 1 best root paths
    (by score, then depth), as a valid tree whose paths were all in the original tree."""
    gen = torch.Generator().manual_seed(seed)
    c = _random_candidates(bs, m, 6, gen, Source.DRAFT) if m else Candidates.empty(bs)
    roots = torch.randint(0, 6, (bs,), generator=gen)
    tree, _ = graft(roots, [c], num_nodes=n)
    w = data.draw(st.integers(2, n))
    small = trim(tree, w)
    small.validate(vocab_size=6)
    assert small.tokens.shape == (bs, w)
    assert torch.equal(small.tokens[:, 0], roots)
    for b in range(bs):
        before, after = _scored_paths(tree, b), _scored_paths(small, b)
        assert after.items() <= before.items(), "trim may only keep paths (and scores) of the tree"
        ranked = sorted(before.items(), key=lambda kv: (-kv[1], len(kv[0])))
        want = dict(ranked[: w - 1])
        assert sorted(after.values(), reverse=True) == sorted(want.values(), reverse=True)
        assert len(after) == min(w - 1, len(before))
    assert trim(tree, n) is tree


def test_graft_selects_the_best_valid_paths():
    gen = torch.Generator().manual_seed(5)
    c = _random_candidates(1, 40, 1000, gen, Source.DRAFT)  # large vocab: no duplicate paths
    n = 12
    tree, _ = graft(torch.tensor([0]), [c], num_nodes=n)
    s = summarise_paths(c)
    alive_scores = torch.where(s.valid, s.min_score, -1.0)[0]
    expected = alive_scores.sort(descending=True).values[: n - 1]
    expected = expected[expected >= 0]
    got = tree.scores[0, 1:][tree.sources[0, 1:] != int(Source.FILLER)].sort(descending=True).values
    assert torch.allclose(got, expected)


def test_dense_graft_equals_eagle_tree_without_ties():
    """With no pruning and no retrieval, grafting picks EAGLE's own tree (the exact fallback)."""
    gen = torch.Generator().manual_seed(9)
    bs, topk, steps, n = 3, 4, 4, 16
    s, t, p = simulate_eagle_draft(bs, topk, steps, vocab=500, gen=gen)
    verified = torch.randint(0, 500, (bs,), generator=gen)
    seq_lens = torch.tensor([5, 7, 9])
    eagle = build_eagle_tree(verified, s, t, p, seq_lens, topk, steps, n)
    tree, _ = graft(verified, [eagle_candidates(s, t, p, topk)], num_nodes=n)
    ours = pack(tree, seq_lens)
    for a, b in zip(ours, eagle):
        assert torch.equal(a, b)


def test_graft_rejects_bad_budget_and_batch():
    c = _chain([[5]], [[0.5]], Source.DRAFT)
    with pytest.raises(ValueError, match="must be >= 2"):
        graft(torch.tensor([1]), [c], num_nodes=1)
    with pytest.raises(ValueError, match="batch size"):
        graft(torch.tensor([1, 2]), [c], num_nodes=3)
    with pytest.raises(ValueError, match="at least one"):
        graft(torch.tensor([1]), [], num_nodes=3)


def test_candidates_validate_names_the_problem():
    c = _chain([[5, -1]], [[0.5, 0.2]], Source.DRAFT)
    with pytest.raises(ValueError, match="negative token id"):
        c.validate()
    c = _chain([[5, 70]], [[0.5, 0.2]], Source.DRAFT)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 50\)"):
        c.validate(vocab_size=50)
    c = _chain([[5, 6]], [[0.5, float("nan")]], Source.DRAFT)
    with pytest.raises(ValueError, match="NaN"):
        c.validate()
    bad = Candidates(torch.tensor([[1, 2]]), torch.tensor([[1, -1]]), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="earlier node"):
        bad.validate()
    with pytest.raises(ValueError, match="shape"):
        Candidates(torch.tensor([[1, 2]]), torch.tensor([[-1]]), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)).validate()


# ---------------------------------------------------------------- pruning


def test_fixed_gates_follow_echo_defaults():
    pruner = ConfidencePruner(GateConfig(mode="fixed"))
    # Depth 1: root top-1 0.15 < 0.2 gates request 0; request 1 continues.
    cont1 = pruner.step_continues(1, torch.tensor([[0.15, 0.1], [0.6, 0.2]]))
    assert cont1.tolist() == [False, True]
    assert pruner.step_continues(2, torch.tensor([[0.01], [0.01]])).tolist() == [True, True]  # no gate at 2
    cont4 = pruner.step_continues(4, torch.tensor([[0.2, 0.1], [0.35, 0.3]]))
    assert cont4.tolist() == [False, True]
    conts = [cont1, torch.tensor([True, True]), torch.tensor([True, True]), cont4]
    assert stop_depths(conts, 2).tolist() == [1, 5]


def test_batch_stops_when_every_request_is_gated():
    pruner = ConfidencePruner(GateConfig(mode="fixed", root_threshold=0.5))
    assert not bool(pruner.step_continues(1, torch.tensor([[0.3, 0.2], [0.4, 0.1]])).any())
    assert bool(pruner.step_continues(1, torch.tensor([[0.3, 0.2], [0.6, 0.1]])).any())


def test_prune_keeps_nodes_up_to_stop_depth_and_above_min_score():
    gen = torch.Generator().manual_seed(1)
    bs, topk, steps = 2, 3, 4
    s, t, p = simulate_eagle_draft(bs, topk, steps, vocab=50, gen=gen)
    drafts = eagle_candidates(s, t, p, topk)
    pruner = ConfidencePruner(GateConfig(mode="fixed", min_node_score=0.05))
    kept = pruner.prune(drafts, torch.tensor([2, 4]))
    depth = summarise_paths(drafts).depth
    assert not bool((kept.valid[0] & (depth[0] > 2)).any())
    assert bool((kept.valid[1] & (depth[1] > 2)).any()) or bool((drafts.scores[1][depth[1] > 2] < 0.05).all())
    assert bool((kept.scores[kept.valid] >= 0.05).all())
    # A pruned tree spends fewer draft slots than the budget: grafting fills the rest.
    tree, _ = graft(torch.tensor([0, 0]), [kept], num_nodes=16)
    assert source_counts(tree)[:, Source.DRAFT].tolist() == kept.valid.sum(1).clamp(max=15).tolist()


def test_gate_config_rejects_bad_values():
    with pytest.raises(ValueError, match="gate mode"):
        GateConfig(mode="magic")
    with pytest.raises(ValueError, match=r"root_threshold must be a probability in \[0, 1\], got 1.5"):
        GateConfig(root_threshold=1.5)
    with pytest.raises(ValueError, match="gate depth must be >= 1"):
        GateConfig(depth_thresholds=((0, 0.3),))
    with pytest.raises(ValueError, match="depth 2"):
        GateConfig(depth_thresholds=((2, -0.3),))


def test_online_calibration_converges_to_true_acceptance():
    """Synthetic stream: the draft says 0.9 at depth 1 but the target accepts 30% of the time;
    says 0.2 at depth 2 and is accepted 60% of the time. Online mode learns both."""
    gen = torch.Generator().manual_seed(0)
    pruner = ConfidencePruner(GateConfig(mode="online", decay=1.0))
    n_obs = 4000
    depths = torch.tensor([1] * n_obs + [2] * n_obs)
    raw = torch.tensor([0.9] * n_obs + [0.2] * n_obs)
    truth = torch.tensor([0.3] * n_obs + [0.6] * n_obs)
    accepted = torch.rand(2 * n_obs, generator=gen) < truth
    pruner.calibrator.observe(depths, confidence_bins(raw, 20), accepted)
    est = pruner.calibrated(torch.tensor([1, 2]), torch.tensor([0.9, 0.2]))
    assert torch.allclose(est, torch.tensor([0.3, 0.6]), atol=0.03)
    # The gate now judges by the calibrated value: raw 0.9 at depth 1 is really 0.3 > 0.2.
    assert pruner.step_continues(1, torch.tensor([[0.9]])).tolist() == [True]
    fixed = ConfidencePruner(GateConfig(mode="fixed"))
    assert torch.equal(fixed.calibrated(torch.tensor([1]), torch.tensor([0.9])), torch.tensor([0.9]))


def test_pruner_observe_learns_from_tree_outcomes():
    pruner = ConfidencePruner(GateConfig(mode="online", decay=1.0, prior_strength=1.0))
    drafts = _chain([[5, 6]], [[0.95, 0.9]], Source.DRAFT)
    kept = pruner.prune(drafts, torch.tensor([5]))
    tree, _ = graft(torch.tensor([1]), [kept], num_nodes=3)
    for _ in range(200):  # depth 1 always accepted, depth 2 never
        pruner.observe(tree, torch.tensor([[True, True, False]]))
    est = pruner.calibrated(torch.tensor([1, 2]), torch.tensor([0.95, 0.9]))
    assert float(est[0]) > 0.99 and float(est[1]) < 0.01


def test_calibrator_decay_tracks_a_shift_and_rejects_bad_settings():
    cal = AcceptanceCalibrator(1, 1, prior_strength=1.0, decay=0.99)
    g = torch.zeros(1, dtype=torch.long)
    for _ in range(500):
        cal.observe(g, g, torch.tensor([True]))
    for _ in range(500):
        cal.observe(g, g, torch.tensor([False]))
    assert float(cal.estimate(g, g, torch.tensor([0.5]))) < 0.05
    with pytest.raises(ValueError, match="decay"):
        AcceptanceCalibrator(1, 1, decay=0.0)
    with pytest.raises(ValueError, match="prior_strength"):
        AcceptanceCalibrator(1, 1, prior_strength=0)
    with pytest.raises(ValueError, match="at least 1x1"):
        AcceptanceCalibrator(0, 3)


def test_tree_from_selection_hangs_orphans_under_root():
    c = _chain([[5, 6, 7]], [[0.5, 0.5, 0.5]], Source.DRAFT)
    tree = tree_from_selection(torch.tensor([1]), c, torch.tensor([[1, 2]]))  # parent column 0 not selected
    tree.validate()
    assert tree.parents[0].tolist() == [-1, 0, 1]
    assert bool(ancestor_mask(tree.parents)[0, 2, 1])


def test_estimate_confidence_is_estimate_on_confidence_buckets():
    cal = AcceptanceCalibrator(5, 10, prior_strength=3.0, decay=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        cal.observe(torch.randint(0, 5, (40,), generator=gen), torch.randint(0, 10, (40,), generator=gen),
                    torch.rand(40, generator=gen) > 0.5)
    conf = torch.cat([torch.rand(30, generator=gen), torch.tensor([0.0, 1.0, 0.999999, -0.5, 1.5])])
    groups = torch.randint(-1, 7, conf.shape, generator=gen)
    assert torch.equal(cal.estimate_confidence(groups, conf), cal.estimate(groups, confidence_bins(conf, 10), conf))
    for g in (-3, 0, 2, 9):
        assert torch.equal(cal.estimate_confidence(g, conf), cal.estimate(g, confidence_bins(conf, 10), conf))


def test_estimate_tables_are_rewritten_in_place_after_observe():
    """A CUDA graph that captured an estimate keeps reading the same table storage."""
    cal = AcceptanceCalibrator(2, 4, prior_strength=2.0)
    conf = torch.tensor([0.1, 0.9])
    before = cal.estimate_confidence(1, conf)
    storage = (cal._base.data_ptr(), cal._slope.data_ptr())
    cal.observe(torch.tensor([1, 1]), torch.tensor([0, 3]), torch.tensor([True, False]))
    cal.refresh_tables()
    assert (cal._base.data_ptr(), cal._slope.data_ptr()) == storage
    after = cal.estimate_confidence(1, conf)
    assert after[0] > before[0] and after[1] < before[1]


def test_out_of_range_buckets_go_to_the_edge_cells():
    cal = AcceptanceCalibrator(3, 4, prior_strength=1.0)
    cal.observe(torch.tensor([-2, 5, 1]), torch.tensor([-1, 9, 2]), torch.tensor([True, True, False]))
    counts = cal.counts()
    assert counts[0, 0] == 1 and counts[2, 3] == 1 and counts[1, 2] == 1 and counts.sum() == 3
    est = cal.estimate(torch.tensor([-2, 5]), torch.tensor([-1, 9]), torch.tensor([0.0, 0.0]))
    assert torch.allclose(est, torch.tensor([0.5, 0.5]))
