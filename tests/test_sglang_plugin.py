"""The SGLang plugin against the real, pinned sglang package (CPU only).

Loading through the entry point, registration, the launch flags and their startup
checks, the hook targets, the audit of name comparisons, and patches.
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points, version
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt.plugins")

from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_graft.sglang import plugin, radix_feed, settings as graft_settings  # noqa: E402
from sglang_graft.sglang.version import SGLangVersionError, check_sglang_version, pinned_sglang_version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SGLANG_DIR = Path(sys.modules["sglang"].__file__).parent


def test_plugin_loads_through_the_entry_point():
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert eps["graft"].value == "sglang_graft.sglang.plugin:register"
    assert eps["graft"].load() is plugin.register
    load_plugins()  # SGLang's own loader, as in the launcher and every scheduler process
    algo = SpeculativeAlgorithm.from_string("GRAFT")
    assert algo.name == "GRAFT"
    assert SpeculativeAlgorithm.from_string("graft_standalone").name == "GRAFT_STANDALONE"


def test_registration_is_idempotent():
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = SpeculativeAlgorithm.from_string("GRAFT")
    plugin.register()
    plugin.register()
    assert SpeculativeAlgorithm.from_string("GRAFT") is before
    for target, hook_name, _ in plugin.HOOKS:
        ours = [h for _, h, _ in HookRegistry._hooks[target] if getattr(h, "__name__", "") == hook_name]
        assert len(ours) == 1, target
        assert target in HookRegistry._patched
    for step, hook_name in plugin.RESOLUTION_HOOKS:
        assert [h.__name__ for h in _HOOKS[step]].count(hook_name) == 1


def test_graft_reports_eagle3_family_capabilities():
    graft = SpeculativeAlgorithm.from_string("GRAFT")
    assert graft.is_eagle() and graft.is_eagle3() and graft.is_speculative() and graft.is_some()
    assert not graft.is_standalone() and not graft.is_ngram() and not graft.is_none()
    assert graft.need_topk() and graft.has_draft_kv() and graft.carries_draft_hidden_states()
    assert graft.get_platform_worker_cls() is None
    assert graft.supports_overlap is False and graft.supports_mixed_chunk() is False
    standalone = SpeculativeAlgorithm.from_string("GRAFT_STANDALONE")
    assert standalone.is_standalone() and not standalone.is_eagle() and not standalone.is_eagle3()
    assert standalone.need_topk() and not standalone.carries_draft_hidden_states()
    # Every predicate of the built-in enum exists on the plugin class (SGLang duck-types them).
    names = [n for n in vars(SpeculativeAlgorithm) if n.startswith(("is_", "supports_", "need_", "carries_", "create_"))]
    for name in names + ["get_platform_worker_cls", "create_worker", "handle_server_args"]:
        assert callable(getattr(graft, name)), name


def test_future_map_is_built_with_the_plugin_algorithm(monkeypatch):
    import sglang.srt.managers.overlap_utils as overlap_utils

    seen = {}

    class Recorder:
        def __init__(self, *args):
            seen["args"] = args

    monkeypatch.setattr(overlap_utils, "FutureMap", Recorder)
    graft = SpeculativeAlgorithm.from_string("GRAFT")
    graft.create_future_map("cpu", "pool", needs_cpu_seq_lens=False, needs_confidence_relay=True)
    assert seen["args"] == ("cpu", graft, "pool", False, True)


def test_version_pin_is_read_from_package_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = project["project"]["optional-dependencies"]["sglang"]
    assert pin == f"sglang=={pinned_sglang_version()}"
    assert check_sglang_version() == version("sglang")


def test_version_mismatch_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("SGLANG_GRAFT_ALLOW_ANY_SGLANG", raising=False)
    with pytest.raises(SGLangVersionError, match=r"pinned to sglang==0\.5\.23 but sglang==0\.6\.0 is installed"):
        check_sglang_version(installed="0.6.0", pinned="0.5.23")
    monkeypatch.setenv("SGLANG_GRAFT_ALLOW_ANY_SGLANG", "1")
    assert check_sglang_version(installed="0.6.0", pinned="0.5.23") == "0.6.0"
    with pytest.raises(SGLangVersionError, match="one exact pin"):
        pinned_sglang_version(['sglang>=0.5; extra == "sglang"'])
    with pytest.raises(SGLangVersionError, match="no sglang requirement"):
        pinned_sglang_version(["torch>=2.4"])


# ---------------------------------------------------------------- launch lines


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama config (no weights): enough for SGLang to resolve a launch on CPU."""
    d = tmp_path_factory.mktemp("tiny_llama")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    }
    (d / "config.json").write_text(json.dumps(config))
    return d


def _launch(model_dir: Path, *extra: str):
    from sglang.srt.server_args import prepare_server_args

    base = ["--model-path", str(model_dir), "--device", "cpu"]
    return prepare_server_args(base + list(extra))


def _graft_line(model_dir: Path, topk: int = 4, n: int = 16, *extra: str):
    return _launch(
        model_dir,
        "--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(model_dir),
        "--speculative-num-steps", "3", "--speculative-eagle-topk", str(topk),
        "--speculative-num-draft-tokens", str(n), *extra,
    )


def test_server_args_accept_a_graft_launch_line(model_dir):
    from sglang.srt.arg_groups.overrides import resolved_view

    sa = _graft_line(model_dir, 4, 16, "--graft-gate-mode", "online", "--graft-sources", "history,context",
                     "--graft-depth-thresholds", "1:0.25,3:0.4", "--graft-history-max-tokens", "5000")
    s = sa._graft_settings
    assert s.gates.mode == "online" and s.gates.depth_thresholds == ((1, 0.25), (3, 0.4))
    assert s.sources == ("context", "history") and s.history_max_tokens == 5000
    sa.resolve_once()
    view = resolved_view(sa)
    assert view.speculative_algorithm == "GRAFT"
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (3, 4, 16)
    assert view.max_running_requests == 48  # EAGLE-family default, set by _handle_eagle_family
    assert view.disable_overlap_schedule  # on CPU SGLang turns overlap off for EAGLE-family algorithms
    # The settings travel with the record into scheduler subprocesses.
    assert pickle.loads(pickle.dumps(sa))._graft_settings == s


def test_server_args_accept_a_standalone_draft(model_dir):
    from sglang.srt.arg_groups.overrides import resolved_view

    sa = _launch(model_dir, "--speculative-algorithm", "GRAFT_STANDALONE", "--speculative-draft-model-path", str(model_dir))
    sa.resolve_once()
    view = resolved_view(sa)
    assert view.speculative_algorithm == "GRAFT_STANDALONE"
    assert view.speculative_eagle_topk > 1  # the target architecture's EAGLE defaults
    assert graft_settings.settings_of(sa) == graft_settings.GraftSettings()


@pytest.mark.parametrize(
    "topk,n,extra,message",
    [
        (1, 4, (), r"needs --speculative-eagle-topk > 1 \(got 1\)"),
        (4, 1, (), r"--speculative-num-draft-tokens \(the verify budget n, root included\) must be >= 2 for GRAFT, got 1"),
        (4, 8, ("--pp-size", "2"), r"pipeline parallelism is not supported"),
    ],
)
def test_server_args_reject_bad_graft_lines(model_dir, topk, n, extra, message):
    sa = _graft_line(model_dir, topk, n, *extra)
    with pytest.raises(ValueError, match=message):
        sa.resolve_once()


def test_graft_needs_a_draft_model(model_dir):
    sa = _launch(model_dir, "--speculative-algorithm", "GRAFT", "--speculative-num-steps", "3",
                 "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8")
    with pytest.raises(ValueError, match="GRAFT needs --speculative-draft-model-path"):
        sa.resolve_once()


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--graft-sources", "context,wikipedia"), r"--graft-sources: unknown source\(s\) \['wikipedia'\]"),
        (("--graft-depth-thresholds", "1=0.2"), r"--graft-depth-thresholds: '1=0.2' is not DEPTH:THRESHOLD"),
        (("--graft-root-threshold", "1.5"), r"root_threshold must be a probability in \[0, 1\], got 1.5"),
        (("--graft-history-max-tokens", "0"), r"--graft-history-max-tokens must be >= 1, got 0"),
        (("--graft-sources", "none"), r"--graft-policy graft needs at least one of --graft-sources"),
    ],
)
def test_bad_graft_flags_are_clear_errors(model_dir, flags, message):
    with pytest.raises(ValueError, match=message):
        _graft_line(model_dir, 4, 8, *flags)


def test_unknown_policy_is_rejected_by_the_parser(model_dir, capsys):
    with pytest.raises(SystemExit):
        _graft_line(model_dir, 4, 8, "--graft-policy", "magic")
    assert "--graft-policy: invalid choice: 'magic'" in capsys.readouterr().err


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv(graft_settings.ENV_ARGS, "--graft-policy pruned --graft-gate-mode online")
    s = graft_settings.settings_of(SimpleNamespace())
    assert s.policy == "pruned" and s.gates.mode == "online"
    monkeypatch.setenv(graft_settings.ENV_ARGS, "--graft-policy pruned --tp 2")
    with pytest.raises(ValueError, match=r"not --graft-\* flags: \['--tp', '2'\]"):
        graft_settings.settings_of(SimpleNamespace())


def test_graphed_core_on_cuda_unless_eager_core(monkeypatch):
    defaults = graft_settings.GraftSettings()
    assert defaults.scheduler_config(8, "cuda").compile_core  # replayed from CUDA graphs
    assert not defaults.scheduler_config(8, "cpu").compile_core  # no AOTInductor builds behind the user's back
    monkeypatch.setenv(graft_settings.ENV_ARGS, "--graft-eager-core")
    s = graft_settings.settings_of(SimpleNamespace())
    assert s.eager_core and not s.scheduler_config(8, "cuda").compile_core


def _resolved(**overrides):
    base = dict(
        speculative_algorithm="GRAFT", speculative_draft_model_path="d", speculative_eagle_topk=4,
        speculative_num_steps=3, speculative_num_draft_tokens=16, disable_overlap_schedule=True, pp_size=1,
        attn_dp_size=1, ep_join_mode="none", disaggregation_mode="null", enable_multi_layer_eagle=False,
        speculative_use_rejection_sampling=False, enable_attn_tp_input_scattered=False, enable_amd_monokernel=False,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"disable_overlap_schedule": False}, "overlap scheduler is not supported.*--disable-overlap-schedule"),
        ({"attn_dp_size": 2}, "data-parallel attention is not supported"),
        ({"disaggregation_mode": "decode"}, "PD disaggregation is not supported"),
        ({"enable_multi_layer_eagle": True}, "--enable-multi-layer-eagle is not supported"),
        ({"speculative_use_rejection_sampling": True}, "--speculative-use-rejection-sampling is not supported"),
        ({"enable_attn_tp_input_scattered": True}, "--enable-attn-tp-input-scattered is not supported"),
        ({"enable_amd_monokernel": True}, "--enable-amd-monokernel is not supported"),
    ],
)
def test_resolved_settings_graft_cannot_run_are_refused(overrides, message):
    from sglang_graft.sglang.server_args_hooks import check_graft_launch

    check_graft_launch(_resolved())  # the baseline is accepted
    with pytest.raises(ValueError, match=message):
        check_graft_launch(_resolved(**overrides))


def test_standalone_draft_may_use_input_scattered_attention():
    from sglang_graft.sglang.server_args_hooks import check_graft_launch

    check_graft_launch(_resolved(speculative_algorithm="GRAFT_STANDALONE", enable_attn_tp_input_scattered=True))


def test_worker_factory_returns_the_graft_workers(model_dir):
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2
    from sglang.srt.speculative.standalone_worker_v2 import StandaloneWorkerV2

    from sglang_graft.sglang import worker

    sa = _graft_line(model_dir)
    sa.resolve_once()
    assert SpeculativeAlgorithm.from_string("GRAFT").create_worker(sa) is worker.GraftWorker
    assert SpeculativeAlgorithm.from_string("GRAFT_STANDALONE").create_worker(sa) is worker.GraftStandaloneWorker
    assert issubclass(worker.GraftWorker, EAGLEWorkerV2) and issubclass(worker.GraftStandaloneWorker, StandaloneWorkerV2)
    assert issubclass(worker.GraftDraftWorker, EagleDraftWorker)
    # Graft overrides the draft side only; verify, KV move and draft extend stay SGLang's.
    for name in ("forward_batch_generation", "_forward_prefill_batch"):
        assert getattr(worker.GraftWorker, name) is getattr(EAGLEWorkerV2, name)
    assert worker.GraftDraftWorker._draft_extend_for_decode is EagleDraftWorker._draft_extend_for_decode


def _bare(cls, **attrs):
    """An instance without running SGLang's constructor (which loads models on a GPU)."""
    obj = object.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


def test_worker_adopts_sglangs_draft_worker_and_reports_per_request():
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    from sglang_graft.sglang import worker
    from sglang_graft.sglang.settings import GraftSettings

    target = SimpleNamespace(model_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=256)))
    spec = _bare(
        worker.GraftWorker, server_args=SimpleNamespace(_graft_settings=GraftSettings(log_interval=7)),
        speculative_num_draft_tokens=16, topk=4, speculative_num_steps=3, device="cpu",
        _target_worker=target, _draft_worker=_bare(EagleDraftWorker),
    )
    with get_parallel().override(tp_rank=1):
        spec._adopt_graft_draft_worker(EagleDraftWorker, worker.GraftDraftWorker)
    session = spec.draft_worker.session
    assert type(spec.draft_worker) is worker.GraftDraftWorker
    assert session.num_nodes == 16 and session.builder.topk == 4 and session.retriever is not None
    assert session.log.interval == 0  # only tensor-parallel rank 0 logs
    assert radix_feed._active is not None and radix_feed._active.history is session.retriever.history
    radix_feed.detach()
    # The per-round counts reach meta_info whole, not sliced per output token.
    assert SchedulerOutputStreamer.is_request_level_customized_info_key(None, "graft_accepted") is True
    assert SchedulerOutputStreamer.is_request_level_customized_info_key(None, "other") is False
    with pytest.raises(RuntimeError, match="expected SGLang to build a EagleDraftWorker draft worker, got GraftDraftWorker"):
        spec._adopt_graft_draft_worker(EagleDraftWorker, worker.GraftDraftWorker)


# ---------------------------------------------------------------- hooks, audit, patches


UPSTREAM_NAMES = (
    "sglang.srt.arg_groups.speculative_hook._handle_eagle_family",
    "sglang.srt.speculative.eagle_worker_common.prepare_for_draft",
    "sglang.srt.speculative.eagle_utils.per_step_draft_out_cache_loc",
    "sglang.srt.speculative.spec_utils.select_top_k_tokens",
    "sglang.srt.speculative.spec_utils.renorm_draft_probs",
    "sglang.srt.utils.common.fast_topk",
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify",
    "sglang.srt.speculative.base_spec_worker.BaseSpecWorker.note_request_finished",
    "sglang.srt.speculative.eagle_info.EagleVerifyInput.max_tree_depth",
    "sglang.srt.speculative.eagle_info.EagleVerifyInput.tree_topk",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore.node_by_id",
)


def test_every_hook_target_resolves():
    import pkgutil

    from sglang.srt.arg_groups.resolution_hooks import _OVERRIDABLE_HOOKS

    from sglang_graft.sglang import worker

    hooks = [(t, plugin_hooks_module(), n) for t, n, _ in plugin.HOOKS]
    hooks += [(t, radix_feed, n) for t, n in radix_feed.RADIX_HOOKS]
    hooks += [(t, worker, n) for t, n in worker.WORKER_HOOKS]
    targets = [t for t, _, _ in hooks] + list(UPSTREAM_NAMES)
    for target in targets:
        assert pkgutil.resolve_name(target) is not None, target
    for step, _ in plugin.RESOLUTION_HOOKS:
        assert step in _OVERRIDABLE_HOOKS
    for _, module, hook_name in hooks:
        assert callable(getattr(module, hook_name))


def plugin_hooks_module():
    from sglang_graft.sglang import server_args_hooks

    return server_args_hooks


def _name_comparisons() -> set[str]:
    """Every ``path:line`` of the installed sglang comparing the algorithm with EAGLE,
    EAGLE3 or STANDALONE, as a string literal or as an enum member."""
    literal = re.compile(r"""(["'])(EAGLE3?|STANDALONE)\1""")
    member = re.compile(r"SpeculativeAlgorithm\.(EAGLE3?|STANDALONE)\b")
    found = set()
    for path in sorted(SGLANG_DIR.rglob("*.py")):
        rel = path.relative_to(SGLANG_DIR).as_posix()
        if not rel.startswith(("srt/", "kernels/")) or "/test/" in rel or rel == "srt/speculative/spec_info.py":
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if literal.search(line) or member.search(line):
                found.add(f"{rel}:{i}")
    return found


def test_audit_lists_every_name_comparison():
    audit = (ROOT / "sglang_graft" / "sglang" / "AUDIT.md").read_text()
    listed = set(re.findall(r"`((?:srt|kernels)/[\w/]+\.py:\d+)`", audit))
    found = _name_comparisons()
    assert len(found) > 30
    assert found - listed == set(), "name comparisons missing from AUDIT.md"
    assert listed - found == set(), "AUDIT.md lists lines that no longer compare names"


def test_patches_apply_cleanly():
    patches = sorted((ROOT / "patches").glob("*.patch"))
    readme = (ROOT / "patches" / "README.md").read_text()
    if not patches:
        assert "There are none" in readme
    for patch in patches:
        run = subprocess.run(
            ["patch", "-p1", "--dry-run", "--forward", "-i", str(patch)],
            cwd=SGLANG_DIR, capture_output=True, text=True,
        )
        assert run.returncode == 0, f"{patch.name}: {run.stdout}{run.stderr}"
