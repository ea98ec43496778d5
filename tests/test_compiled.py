"""The AOTInductor-compiled round (and draft gate) equals the eager one, follows live
calibration, is cached, refuses a package that disagrees, and keeps the reference engine
lossless.

Compiling takes 15-40 s per shape on a small CPU, so the tests share one cache directory
and few shapes.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from helpers import TEST_DEVICE, simulate_eagle_draft
from sglang_graft import compiled as compiled_mod
from sglang_graft.candidates import Candidates, Source
from sglang_graft.compiled import CompiledGate, CompiledRound, CompileError, pad_candidates
from sglang_graft.engine import EngineConfig, SpecEngine, tiny_models
from sglang_graft.prune import ConfidencePruner, GateConfig
from sglang_graft.scheduler import GraftScheduler, SchedulerConfig, prune_and_graft
from sglang_graft.tree import child_links, eagle_candidates

TOPK, STEPS, N, BS = 2, 3, 8, 2
needs_compiler = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")),
    reason="no C++ compiler, AOTInductor cannot build packages (scripts/setup.sh installs g++ where it can)",
)
GATES = GateConfig(min_node_score=0.05)


def eagle_round(seed: int, bs: int = BS) -> tuple[Candidates, torch.Tensor, Candidates, torch.Tensor]:
    """Random EAGLE draft outputs (``TOPK`` x ``STEPS``), gate masks, a retrieved chain
    that repeats one drafted path (so merging happens) and the roots."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 50
    scores, tokens, parents = simulate_eagle_draft(bs, TOPK, STEPS, vocab, gen)
    drafts = eagle_candidates(scores, tokens, parents, TOPK)
    m = 4
    chain_tokens = torch.randint(0, vocab, (bs, m), generator=gen)
    chain_tokens[:, 0] = drafts.tokens[:, 0]  # the chain starts on the best draft child
    retrieved = Candidates(
        tokens=chain_tokens,
        parents=(torch.arange(m) - 1).expand(bs, m).clone(),
        scores=torch.tensor([0.7, 0.5, 0.3, 0.2]).expand(bs, m).clone(),
        sources=torch.full((bs, m), int(Source.CONTEXT)),
        valid=torch.tensor([True, True, True, False]).expand(bs, m).clone(),
        bins=torch.randint(0, 4, (bs, m), generator=gen),
    )
    continues = torch.rand(bs, STEPS - 1, generator=gen) > 0.3
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    return drafts, continues, retrieved, roots


def eager(pruner, drafts, continues, retrieved, roots):
    result = prune_and_graft(pruner, roots, drafts, list(continues.unbind(1)), retrieved, N)
    return result, child_links(result.tree.parents)


def assert_same(compiled_result, eager_pair) -> None:
    expected, links = eager_pair
    for name in ("tokens", "parents", "depths", "scores", "sources", "bins", "ancestors"):
        assert torch.equal(getattr(compiled_result.tree, name), getattr(expected.tree, name)), name
    assert torch.equal(compiled_result.num_merged, expected.num_merged)
    for got, want in zip(compiled_result.tree.child_links(), links):
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compiled")


@pytest.fixture(scope="module")
def warm_cache(cache_dir):
    """Compile the test shape once (the first test to need it pays)."""
    pruner = ConfidencePruner(GATES)
    drafts, continues, retrieved, roots = eagle_round(0)
    with torch.inference_mode():
        CompiledRound(pruner, N, cache_dir)(roots, drafts, continues, retrieved)
    return cache_dir


def test_padding_keeps_the_tree():
    pruner = ConfidencePruner(GATES)
    merged = 0
    for seed in range(5):
        drafts, continues, retrieved, roots = eagle_round(seed)
        plain, _ = eager(pruner, drafts, continues, retrieved, roots)
        gates = torch.cat([continues, torch.ones(BS, 3, dtype=torch.bool)], dim=1)
        padded, _ = eager(pruner, pad_candidates(drafts, 32), gates, pad_candidates(retrieved, 8), roots)
        for name in ("tokens", "parents", "depths", "scores", "sources", "bins"):
            assert torch.equal(getattr(padded.tree, name), getattr(plain.tree, name)), (seed, name)
        merged += int(plain.num_merged.sum())
    assert merged > 0, "the chains should merge into the drafts: the test must cover merging"
    with pytest.raises(ValueError, match="cannot pad 2 x 10 candidates down to 2 x 4"):
        pad_candidates(drafts, 4)


def test_padding_rows_keeps_every_real_tree():
    pruner = ConfidencePruner(GATES)
    drafts, continues, retrieved, roots = eagle_round(7, bs=3)
    plain, _ = eager(pruner, drafts, continues, retrieved, roots)
    gates = torch.cat([continues, torch.ones(1, continues.shape[1], dtype=torch.bool)])
    padded, _ = eager(pruner, pad_candidates(drafts, 16, 4), gates, pad_candidates(retrieved, 8, 4),
                      torch.cat([roots, roots.new_zeros(1)]))
    for name in ("tokens", "parents", "depths", "scores", "sources", "bins"):
        assert torch.equal(getattr(padded.tree, name)[:3], getattr(plain.tree, name)), name
    assert bool((padded.tree.sources[3, 1:] == int(Source.FILLER)).all())


@needs_compiler
def test_compiled_round_equals_eager_and_reads_live_calibration(warm_cache):
    pruner = ConfidencePruner(GATES)
    round_ = CompiledRound(pruner, N, warm_cache)
    drafts, continues, retrieved, roots = eagle_round(1)
    with torch.inference_mode():
        before = round_(roots, drafts, continues, retrieved)
        assert_same(before, eager(pruner, drafts, continues, retrieved, roots))
        # Teach the calibration that depth-1 drafts are always rejected: the same inputs
        # must now score (and may select) differently, in both paths alike.
        depths = torch.ones(64, dtype=torch.int64)
        pruner.calibrator.observe(depths, torch.arange(64) % GATES.num_bins, torch.zeros(64, dtype=torch.bool))
        after = round_(roots, drafts, continues, retrieved)
        assert_same(after, eager(pruner, drafts, continues, retrieved, roots))
        for seed in (2, 3):
            inputs = eagle_round(seed)
            assert_same(round_(inputs[3], inputs[0], inputs[1], inputs[2]), eager(pruner, *inputs))
    assert not torch.equal(before.tree.scores, after.tree.scores)


@needs_compiler
def test_compiled_gate_equals_the_eager_gate_and_follows_calibration(cache_dir, monkeypatch):
    """Three requests (a padded bucket of four), every depth, before and after observes;
    and a scheduler's gates with ``compile_core`` against one without."""
    pruner = ConfidencePruner(GATES)
    gate = CompiledGate(pruner, cache_dir)
    gen = torch.Generator().manual_seed(5)
    level = [torch.rand(3, 1, TOPK, generator=gen)] + [torch.rand(3, TOPK, TOPK, generator=gen) for _ in range(4)]
    with torch.inference_mode():
        before = [gate.gate(d, s) for d, s in enumerate(level, start=1)]
        for d, (got, s) in enumerate(zip(before, level), start=1):
            want = pruner.gate(d, s)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), d
        assert before[0][1].shape == (3,) and before[0][1].dtype == torch.bool
        depths = torch.arange(1, 6).repeat_interleave(GATES.num_bins)  # every (depth, bin) cell
        bins = torch.arange(GATES.num_bins).repeat(5)
        pruner.calibrator.observe(depths, bins, bins % 3 == 0)
        for d, s in enumerate(level, start=1):
            got, want = gate.gate(d, s), pruner.gate(d, s)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), d
        assert not torch.equal(gate.gate(2, level[1])[0], before[1][0]), "the counts moved"
        monkeypatch.setenv("SGLANG_GRAFT_CACHE", str(cache_dir.parent))
        for ratio in (None, 0.3):
            config = SchedulerConfig("pruned", N, GATES, draft_cost_ratio=ratio, draft_depth=5)
            fast = GraftScheduler(SchedulerConfig(**{**config.__dict__, "compile_core": True}))
            plain = GraftScheduler(config)
            for d, s in enumerate(level, start=1):
                assert torch.equal(fast.draft_continues(d, s), plain.draft_continues(d, s)), (ratio, d)
    with pytest.raises(ValueError, match="only online gates are compiled"):
        CompiledGate(ConfidencePruner(GateConfig(mode="fixed")), cache_dir)


@needs_compiler
def test_package_is_reused_from_disk(warm_cache, monkeypatch):
    def no_compiling(*args, **kwargs):
        raise AssertionError("the cached package should have been loaded")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
    pruner = ConfidencePruner(GATES)
    drafts, continues, retrieved, roots = eagle_round(4)
    with torch.inference_mode():
        got = CompiledRound(pruner, N, warm_cache)(roots, drafts, continues, retrieved)
    assert_same(got, eager(pruner, drafts, continues, retrieved, roots))


@needs_compiler
def test_a_package_that_disagrees_is_refused(warm_cache, monkeypatch):
    real_load = torch._inductor.aoti_load_package

    class Corrupt:
        def __init__(self, path):
            self.loader = self
            self.real = real_load(path)

        def boxed_run(self, inputs):
            out = list(self.real.loader.boxed_run(inputs))
            out[0] = out[0] + 1  # wrong tokens
            return out

    monkeypatch.setattr(torch._inductor, "aoti_load_package", Corrupt)
    drafts, continues, retrieved, roots = eagle_round(0)
    with pytest.raises(CompileError, match="disagrees with the eager round"), torch.inference_mode():
        CompiledRound(ConfidencePruner(GATES), N, warm_cache)(roots, drafts, continues, retrieved)


def test_compile_failure_names_the_fix(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)
    drafts, continues, retrieved, roots = eagle_round(0)
    with pytest.raises(CompileError, match=r"C\+\+ compiler.*without --compile-core"), torch.inference_mode():
        CompiledRound(ConfidencePruner(GATES), N, tmp_path)(roots, drafts, continues, retrieved)
    assert list(tmp_path.iterdir()) == [], "a failed build must not leave files behind"


def test_buckets_are_powers_of_two():
    assert [compiled_mod._bucket(w) for w in (0, 1, 8, 9, 16, 17, 68)] == [8, 8, 8, 16, 16, 32, 128]
    assert [compiled_mod._bucket(b, least=1) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


@needs_compiler
def test_engine_with_compiled_core_is_lossless(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_GRAFT_CACHE", str(tmp_path))
    torch.set_num_threads(1)
    target, draft = tiny_models("llama", vocab_size=200, seed=1, hidden=32)
    # Two requests of different lengths: a batch of 2 (then 1 once the first finishes).
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 11, 12, 13, 14, 15], [3, 1, 4, 1, 5, 9, 2, 6]]
    ar = SpecEngine(target, None, EngineConfig(policy="ar")).generate(prompts, 16).requests
    settings = dict(policy="graft", num_nodes=8, draft_depth=2, draft_topk=2, draft_cost_ratio=0.3)
    plain = SpecEngine(target, draft, EngineConfig(**settings)).generate(prompts, 16).requests
    fast = SpecEngine(target, draft, EngineConfig(**settings, compile_core=True)).generate(prompts, 16).requests
    for f, p, a in zip(fast, plain, ar):
        assert f.token_ids == a.token_ids
        assert (f.rounds, f.draft_forwards, f.accepted) == (p.rounds, p.draft_forwards, p.accepted)
    assert sum(sum(f.accepted.values()) for f in fast) > 0 and sum(f.draft_forwards for f in fast) > 0
    assert any(p.name.endswith(".pt2") for p in (tmp_path / "compiled").iterdir())


def test_cache_is_bounded_and_left_over_temp_files_go(tmp_path, monkeypatch):
    monkeypatch.setattr(compiled_mod, "MAX_PACKAGES", 3)
    for i in range(5):
        (tmp_path / f"round-{i}.pt2").write_bytes(b"x")
        compiled_mod.os.utime(tmp_path / f"round-{i}.pt2", (1000 + i, 1000 + i))
    stale, fresh = tmp_path / "tmpold.pt2", tmp_path / "tmpnew.pt2"
    stale.write_bytes(b"")
    compiled_mod.os.utime(stale, (1, 1))
    fresh.write_bytes(b"")
    compiled_mod._tidy(tmp_path, keep=tmp_path / "round-0.pt2")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["round-0.pt2", "round-2.pt2", "round-3.pt2", "round-4.pt2", "tmpnew.pt2"]


needs_cuda = pytest.mark.skipif(
    TEST_DEVICE.type != "cuda",
    reason="CUDA graphs of the round: run with SGLANG_GRAFT_TEST_DEVICE=cuda on a GPU (scripts/gpu_check.sh does)",
)


def device_round(seed: int, bs: int = BS):
    drafts, continues, retrieved, roots = eagle_round(seed, bs)
    return drafts.to(TEST_DEVICE), continues.to(TEST_DEVICE), retrieved.to(TEST_DEVICE), roots.to(TEST_DEVICE)


@needs_cuda
def test_cuda_graph_round_equals_eager_and_reads_live_calibration(tmp_path):
    """On CUDA, ``CompiledRound`` replays a captured graph: equal to the eager round before
    and after the calibration moves, across batch buckets, with nothing written to disk."""
    pruner = ConfidencePruner(GATES, device=TEST_DEVICE)
    round_ = CompiledRound(pruner, N, tmp_path)
    drafts, continues, retrieved, roots = device_round(1)
    with torch.inference_mode():
        before = round_(roots, drafts, continues, retrieved)
        assert_same(before, eager(pruner, drafts, continues, retrieved, roots))
        depths = torch.ones(64, dtype=torch.int64, device=TEST_DEVICE)
        bins = torch.arange(64, device=TEST_DEVICE) % GATES.num_bins
        pruner.calibrator.observe(depths, bins, torch.zeros(64, dtype=torch.bool, device=TEST_DEVICE))
        after = round_(roots, drafts, continues, retrieved)
        assert_same(after, eager(pruner, drafts, continues, retrieved, roots))
        for seed, bs in ((2, 2), (3, 3), (4, 1)):
            d, c, r, roots = device_round(seed, bs)
            got = round_.bucketed(roots, d, list(c.unbind(1)), r, STEPS - 1)
            assert_same(got, eager(pruner, d, c, r, roots))
    assert not torch.equal(before.tree.scores, after.tree.scores)
    assert len(round_._runners) == 4  # bs 2 (twice), 4 (bucket of 3), 1
    assert not any(tmp_path.iterdir()), "a CUDA graph needs no package on disk"


@needs_cuda
def test_cuda_graph_gate_equals_eager_and_runs_eagerly_inside_a_capture():
    pruner = ConfidencePruner(GATES, device=TEST_DEVICE)
    gate = CompiledGate(pruner)
    gen = torch.Generator().manual_seed(5)
    level = [torch.rand(3, TOPK, TOPK, generator=gen).to(TEST_DEVICE) for _ in range(3)]
    with torch.inference_mode():
        for d, s in enumerate(level, start=1):
            got, want = gate.gate(d, s), pruner.gate(d, s)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), d
    runners = len(gate._runners)
    # Inside a caller's capture (SGLang's draft CUDA graph) the eager ops are captured instead.
    static = level[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        captured = gate.gate(1, static)
    static.copy_(level[1])
    graph.replay()
    want = pruner.gate(1, level[1])
    assert torch.equal(captured[0], want[0]) and torch.equal(captured[1], want[1])
    assert len(gate._runners) == runners


@needs_cuda
def test_engine_with_cuda_graph_core_is_lossless(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_GRAFT_CACHE", str(tmp_path))
    target, draft = (m.to(TEST_DEVICE) for m in tiny_models("llama", vocab_size=200, seed=1, hidden=32))
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 11, 12, 13, 14, 15], [3, 1, 4, 1, 5, 9, 2, 6], [7, 7]]
    ar = SpecEngine(target, None, EngineConfig(policy="ar")).generate(prompts, 24).requests
    for policy in ("pruned", "graft"):
        settings = dict(policy=policy, num_nodes=8, draft_depth=3, draft_topk=2, draft_cost_ratio=0.3)
        plain = SpecEngine(target, draft, EngineConfig(**settings)).generate(prompts, 24).requests
        fast = SpecEngine(target, draft, EngineConfig(**settings, compile_core=True)).generate(prompts, 24).requests
        for f, p, a in zip(fast, plain, ar):
            assert f.token_ids == a.token_ids, policy
            assert (f.rounds, f.draft_forwards, f.accepted) == (p.rounds, p.draft_forwards, p.accepted), policy
        assert sum(sum(f.accepted.values()) for f in fast) > 0
    assert not (tmp_path / "compiled").exists()


@needs_cuda
def test_sglang_tree_builder_replays_the_round_on_cuda():
    """The plugin's tree step with its default (graphed) core against ``--graft-eager-core``,
    over rounds whose outcomes move the calibration in between."""
    from sglang_graft.sglang.settings import GraftSettings
    from sglang_graft.sglang.tree_step import DraftOutputs, TreeBuilder, flatten_draft_steps

    gates = GateConfig(mode="online", root_threshold=0.1, depth_thresholds=((2, 0.2),), min_node_score=0.02)
    builders = [TreeBuilder(GraftSettings(policy="pruned", gates=gates, eager_core=eager), 8, TOPK, STEPS,
                            device=TEST_DEVICE) for eager in (False, True)]
    assert builders[0].scheduler.compiled is not None and builders[1].scheduler.compiled is None
    for seed in range(6):
        bs = 1 + seed % 3
        gen = torch.Generator().manual_seed(seed)
        s, t, p = (list(map(lambda x: x.to(TEST_DEVICE), xs)) for xs in simulate_eagle_draft(bs, TOPK, STEPS, 50, gen))
        roots = torch.randint(0, 50, (bs,), generator=gen).to(TEST_DEVICE)
        seq_lens = torch.randint(4, 30, (bs,), generator=gen).to(TEST_DEVICE)
        rids = [f"r{i}" for i in range(bs)]
        out = []
        for b in builders:
            continues = [b.draft_continues(d + 1, s[d]) for d in range(STEPS - 1)]
            drafts = DraftOutputs.from_flat(*flatten_draft_steps(s, t, p, continues), topk=TOPK)
            out.append(b.build(rids, roots, drafts, seq_lens, "full", int(seq_lens.sum())))
        for name in ("tokens", "parents", "scores", "sources"):
            assert torch.equal(getattr(out[0].tree, name), getattr(out[1].tree, name)), (seed, name)
        for a, b in zip(out[0].layout, out[1].layout):
            assert torch.equal(a, b), seed
        accepted = torch.rand(bs, 8, generator=gen).to(TEST_DEVICE) < 0.5
        accepted[:, 0] = True
        for b, o in zip(builders, out):
            b.scheduler.observe(rids, o.tree, accepted)
