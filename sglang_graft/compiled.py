"""Graft's round compiled ahead of time: the eager code, in one native call per round.

Eager PyTorch pays a few microseconds of dispatch for every tensor op, and a round of
pruning, grafting and child links is a few hundred ops on tensors of a few dozen elements,
so on a CPU nearly all of its time is dispatch. AOTInductor traces the very functions the
eager path runs (``prune_and_graft``, then ``child_links``) for one static shape and
compiles them into a shared library that runs the round in one call, about ten times
faster at batch size 1 (``scripts/bench_core.py --compiled``). The online gates'
estimate and verdict after each draft level (``CompiledGate``) are compiled the same
way: about a dozen ops between two draft forwards, in one call.

Each package is cached on disk, keyed by the shapes, the gate settings, the torch
version and the source of every module it traces, so a configuration is compiled once
(20-40 s on a 2-core CPU) and reloaded afterwards. Before its first use a package
must reproduce the eager round exactly on that round's inputs, or it is refused.

On a CUDA device the same modules are captured in CUDA graphs instead (``capture_graph``):
there the cost is one kernel launch per op rather than dispatch, a graph replays the
round's few hundred launches as one (on an H200: 3.2-5.4 ms eager, 0.3-0.5 ms replayed),
and capturing takes milliseconds, so nothing is compiled or cached on disk.

Shapes are static: pad drafted and retrieved candidates to fixed widths first
(``pad_candidates``; padding columns are invalid, and grafting never sees invalid nodes,
so the tree is the one the unpadded inputs give); each batch size gets its own package.
The calibration counts are inputs, not constants, so estimates follow every ``observe``.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from sglang_graft.candidates import Candidates
from sglang_graft.graft import GraftResult
from sglang_graft.prune import ConfidencePruner
from sglang_graft.tree import TokenTree, child_links

log = logging.getLogger(__name__)

#: Modules whose code a compiled round runs; their source is part of the cache key.
_TRACED_MODULES = (
    "sglang_graft.candidates",
    "sglang_graft.calibration",
    "sglang_graft.prune",
    "sglang_graft.graft",
    "sglang_graft.tree",
    "sglang_graft.scheduler",
    "sglang_graft.compiled",
)
#: Inductor settings per device type. On CPU the round's tensors hold a few dozen
#: elements: scalar loops beat vector code with masked tails and emulated gathers (about
#: 1.5x on a 2-core Xeon), realizing small intermediates keeps the pointer-doubling
#: chains from being inlined into a few thousand lines of generated code, and one planned
#: buffer instead of ~40 allocations per call saves about 8%.
_INDUCTOR_SETTINGS: dict[str, dict[str, object]] = {
    "cpu": {"cpp.simdlen": 1, "realize_opcount_threshold": 8, "memory_planning": True}
}
#: Packages kept in the cache directory (about 2 MB each), least recently used evicted.
MAX_PACKAGES = 64
_CANDIDATE_FIELDS = tuple(f.name for f in fields(Candidates))
#: A loaded package: runs the flat input list, returns the flat outputs.
Runner = Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]
_TREE_FIELDS = ("tokens", "parents", "depths", "scores", "sources", "bins", "ancestors")


class CompileError(RuntimeError):
    """A round could not be compiled, or its package disagrees with the eager round."""


class _HideIsaNote(logging.Filter):
    """Drops torch's note that a package was built without vector code: intended here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "AOTI_CPU_ISA" not in record.getMessage()


def cache_root() -> Path:
    """Where the project keeps what it builds: ``$SGLANG_GRAFT_CACHE``, else ``~/.cache/sglang-graft``."""
    return Path(os.environ.get("SGLANG_GRAFT_CACHE") or Path.home() / ".cache" / "sglang-graft")


def default_cache_dir() -> Path:
    """``cache_root() / "compiled"``."""
    return cache_root() / "compiled"


def pad_candidates(c: Candidates, width: int, rows: int | None = None) -> Candidates:
    """``c`` widened to ``width`` columns (and ``rows`` requests) with invalid padding,
    which grafting ignores: real rows keep their tree, padding rows get filler trees."""
    rows = c.batch_size if rows is None else rows
    extra, extra_rows = width - c.width, rows - c.batch_size
    if extra < 0 or extra_rows < 0:
        raise ValueError(f"cannot pad {c.batch_size} x {c.width} candidates down to {rows} x {width}")
    if extra == 0 and extra_rows == 0:
        return c

    def grow(t: torch.Tensor | None, value: float | int | bool) -> torch.Tensor | None:
        return None if t is None else F.pad(t, (0, extra, 0, extra_rows), value=value)

    return Candidates(
        tokens=grow(c.tokens, 0),
        parents=grow(c.parents, -1),
        scores=grow(c.scores, 0.0),
        sources=grow(c.sources, 0),
        valid=grow(c.valid, False),
        bins=grow(c.bins, 0),
        depths=grow(c.depths, 1),
        levels=grow(c.levels, 1),
    )


def _bucket(size: int, least: int = 8) -> int:
    """The smallest power of two >= ``size``, and at least ``least``."""
    return max(least, 1 << max(size - 1, 0).bit_length())


def _present(c: Candidates | None) -> tuple[str, ...]:
    """The names of ``c``'s tensor fields, in declaration order (none for no candidates)."""
    return () if c is None else tuple(f for f in _CANDIDATE_FIELDS if getattr(c, f) is not None)


@dataclass(frozen=True)
class RoundSignature:
    """What one compiled package is specialised to (besides the gate settings)."""

    num_nodes: int
    draft_fields: tuple[str, ...]
    retrieved_fields: tuple[str, ...]
    inputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # shape and dtype of each flat input
    device: str

    def describe(self) -> str:
        shapes = [shape for shape, _ in self.inputs]  # roots, gates, counts x2, drafts..., retrieved...
        nd = len(self.draft_fields)
        draft_width = shapes[4][1] if nd else 0
        retrieved_width = shapes[4 + nd][1] if self.retrieved_fields else 0
        return (
            f"bs={shapes[0][0]} n={self.num_nodes} gate levels={shapes[1][1]} draft columns={draft_width} "
            f"retrieved columns={retrieved_width} on {self.device}"
        )

    @staticmethod
    def of(key: tuple, num_nodes: int, device: torch.device) -> "RoundSignature":
        """From ``_flat_inputs``'s lookup key."""
        draft_fields, retrieved_fields, *inputs = key
        return RoundSignature(
            num_nodes=num_nodes,
            draft_fields=draft_fields,
            retrieved_fields=retrieved_fields,
            inputs=tuple((tuple(shape), dtype) for shape, dtype in inputs),
            device=device.type,
        )


class _RoundModule(torch.nn.Module):
    """``prune_and_graft`` then ``child_links`` over flat tensor inputs, for ``torch.export``."""

    def __init__(self, pruner: ConfidencePruner | None, signature: RoundSignature) -> None:
        super().__init__()
        self.pruner = pruner
        self.signature = signature

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from sglang_graft.scheduler import prune_and_graft  # the scheduler imports this module

        sig = self.signature
        roots, continues, proposed, accepted, *rest = flat
        nd = len(sig.draft_fields)
        drafts = Candidates(**dict(zip(sig.draft_fields, rest[:nd]))) if nd else None
        retrieved = Candidates(**dict(zip(sig.retrieved_fields, rest[nd:]))) if sig.retrieved_fields else None
        pruner = None if self.pruner is None else self.pruner.with_counts(proposed, accepted)
        return round_outputs(prune_and_graft(pruner, roots, drafts, continues.unbind(1), retrieved, sig.num_nodes))


def round_outputs(result: GraftResult) -> tuple[torch.Tensor, ...]:
    """A round as flat tensors: the tree's fields, ``num_merged``, then its child links
    (what a package returns; also what a CUDA graph of the round would capture)."""
    tree = result.tree
    return (*(getattr(tree, f) for f in _TREE_FIELDS), result.num_merged, *child_links(tree.parents))


def _flat_inputs(
    root_tokens: torch.Tensor,
    drafts: Candidates | None,
    continues: torch.Tensor,
    retrieved: Candidates | None,
    counts: tuple[torch.Tensor, torch.Tensor],
) -> tuple[list[torch.Tensor], tuple]:
    """The package's flat inputs, and the key of their signature (field names, then the
    shape and dtype of every input): built on every call, so kept to one pass."""
    draft_fields, retrieved_fields = _present(drafts), _present(retrieved)
    flat = [root_tokens, continues, *counts]
    flat += [getattr(drafts, f) for f in draft_fields]
    flat += [getattr(retrieved, f) for f in retrieved_fields]
    # A package reads its inputs with the strides it was traced with: hand it dense ones.
    flat = [t if t.is_contiguous() else t.contiguous() for t in flat]
    return flat, (draft_fields, retrieved_fields, *[(t.shape, t.dtype) for t in flat])


def _source_digest() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for name in _TRACED_MODULES:
        h.update(Path(importlib.import_module(name).__file__ or "").read_bytes())
    return h.hexdigest()


def _tidy(cache_dir: Path, keep: Path) -> None:
    """Bound the cache: drop the least recently used packages beyond ``MAX_PACKAGES``, and
    temporary files that an interrupted build left behind (older than an hour, so a
    concurrent build's file is never touched)."""
    now = time.time()
    for tmp in cache_dir.glob("tmp*.pt2"):
        if now - tmp.stat().st_mtime > 3600:
            tmp.unlink(missing_ok=True)
    built = (p for p in cache_dir.glob("*.pt2") if not p.name.startswith("tmp"))
    packages = sorted(built, key=lambda p: p.stat().st_mtime, reverse=True)
    for old in packages[MAX_PACKAGES:]:
        if old != keep:
            log.info("evicting the least recently used compiled package %s", old.name)
            old.unlink(missing_ok=True)


class CompiledRound:
    """``prune_and_graft`` + ``child_links``, compiled once per ``RoundSignature``.

    Args:
        pruner: the scheduler's pruner (its gate settings are compiled in, its calibration
            counts are read live every call), or None for policies without gates.
        num_nodes: the verify budget ``n``.
        cache_dir: where packages live (``default_cache_dir()`` when None).
    """

    def __init__(self, pruner: ConfidencePruner | None, num_nodes: int, cache_dir: Path | None = None) -> None:
        self.pruner = pruner
        self.num_nodes = num_nodes
        self.cache_dir = cache_dir or default_cache_dir()
        self._runners: dict[tuple, Runner] = {}
        self._graphs = GraphPool()

    def __call__(
        self,
        root_tokens: torch.Tensor,
        drafts: Candidates | None,
        continues: torch.Tensor,
        retrieved: Candidates | None,
    ) -> GraftResult:
        """The same ``GraftResult`` as ``prune_and_graft(pruner, root_tokens, drafts,
        continues.unbind(1), retrieved, num_nodes)``, with the tree's child links set.

        ``continues`` is ``[bs, L]`` bool (column ``d - 1``: may each request draft past
        level ``d``). The first call of a new signature compiles or loads its package.
        """
        flat, key = _flat_inputs(root_tokens, drafts, continues, retrieved, self._counts(root_tokens.device))
        runner = self._runners.get(key)
        if runner is None:
            sig = RoundSignature.of(key, self.num_nodes, root_tokens.device)
            runner = self._runners[key] = self._load(sig, tuple(flat))
        out = runner(flat)
        tree = TokenTree(*out[: len(_TREE_FIELDS)], links=(out[-2], out[-1]))  # type: ignore[misc]
        return GraftResult(tree, out[len(_TREE_FIELDS)])

    def bucketed(
        self,
        root_tokens: torch.Tensor,
        drafts: Candidates | None,
        continues: Sequence[torch.Tensor],
        retrieved: Candidates | None,
        max_levels: int,
    ) -> GraftResult:
        """``__call__`` for inputs whose shapes change from round to round (an engine's):
        the batch and the candidate widths are padded up to powers of two and the gate
        masks to ``max_levels`` columns, so a handful of packages serve every round."""
        bs = root_tokens.shape[0]
        rows = _bucket(bs, least=1)
        gates = torch.ones(rows, max(max_levels, len(continues)), dtype=torch.bool, device=root_tokens.device)
        if continues:
            gates[:bs, : len(continues)] = torch.stack(list(continues), dim=1)
        drafts = None if drafts is None else pad_candidates(drafts, _bucket(drafts.width), rows)
        retrieved = None if retrieved is None else pad_candidates(retrieved, _bucket(retrieved.width), rows)
        result = self(F.pad(root_tokens, (0, rows - bs)), drafts, gates, retrieved)
        if rows == bs:
            return result
        t = result.tree
        links = t.child_links()
        tree = TokenTree(
            *(getattr(t, f)[:bs] for f in _TREE_FIELDS), links=(links[0][:bs], links[1][:bs])  # type: ignore[misc]
        )
        return GraftResult(tree, result.num_merged[:bs])

    def _counts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pruner is None:
            z = torch.zeros(1, dtype=torch.float64, device=device)
            return z, z
        cal = self.pruner.calibrator
        return cal.proposed, cal.accepted

    def _key(self, sig: RoundSignature) -> str:
        gates = repr(None if self.pruner is None else self.pruner.config)
        return hashlib.sha256(f"{_source_digest()}|{sig}|{gates}".encode()).hexdigest()[:24]

    def _load(self, sig: RoundSignature, flat: tuple[torch.Tensor, ...]) -> Runner:
        module, what = _RoundModule(self.pruner, sig), f"the Graft round for {sig.describe()}"
        if sig.device == "cuda":
            return capture_graph(module, flat, what, self._graphs.handle())
        return load_package(module, flat, self.cache_dir / f"round-{self._key(sig)}.pt2", what)


class _GateModule(torch.nn.Module):
    """The pruner's gate after one draft level, over flat tensor inputs: the calibrated
    confidence and the verdict (a negative ``threshold`` stands for "no gate here")."""

    def __init__(self, pruner: ConfidencePruner) -> None:
        super().__init__()
        self.pruner = pruner

    def forward(
        self,
        step_scores: torch.Tensor,
        depth: torch.Tensor,
        threshold: torch.Tensor,
        proposed: torch.Tensor,
        accepted: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        confidence = self.pruner.with_counts(proposed, accepted).level_confidence(depth, step_scores)
        return confidence, (confidence >= threshold) | (threshold < 0)


class CompiledGate:
    """``ConfidencePruner.gate``, compiled once per batch bucket and score shape.

    After every draft level the online gates turn each request's best path score into a
    calibrated estimate and compare it with the level's threshold: about a dozen tensor
    ops, between two draft forwards, which on the CPU cost far more than the arithmetic.
    The package does them in one call; the depth, the threshold and the calibration counts
    are inputs, so one package serves every depth and follows every ``observe``. Only the
    online mode has anything to compile (the fixed mode's confidence is the raw score).
    On CUDA the gate is a captured graph, except while the caller's stream is itself being
    captured (SGLang's draft CUDA graph): then the eager ops run, into the caller's graph.
    """

    def __init__(self, pruner: ConfidencePruner, cache_dir: Path | None = None) -> None:
        if pruner.config.mode != "online":
            raise ValueError(f"only online gates are compiled, got mode {pruner.config.mode!r}")
        self.pruner = pruner
        self.cache_dir = cache_dir or default_cache_dir()
        self._runners: dict[tuple, Runner] = {}
        self._levels: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphs = GraphPool()

    def gate(self, depth: int, step_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same ``[bs]`` float32 confidence and ``[bs]`` bool verdict as
        ``pruner.gate(depth, step_scores)``."""
        if step_scores.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.pruner.gate(depth, step_scores)  # a graph cannot launch another mid-capture
        bs = step_scores.shape[0]
        rows = _bucket(bs, least=1)
        if rows != bs:
            step_scores = F.pad(step_scores, (0, 0) * (step_scores.dim() - 1) + (0, rows - bs))
        elif not step_scores.is_contiguous():
            step_scores = step_scores.contiguous()
        device = step_scores.device
        level = self._levels.get((depth, device))
        if level is None:
            threshold = self.pruner.config.threshold_at(depth)
            level = self._levels[(depth, device)] = (
                torch.tensor(depth, device=device),
                torch.tensor(-1.0 if threshold is None else threshold, device=device),
            )
        cal = self.pruner.calibrator
        flat = [step_scores, *level, cal.proposed, cal.accepted]
        key = (step_scores.shape, step_scores.dtype, device.type)
        runner = self._runners.get(key)
        if runner is None:
            what = f"the draft gate for bs={rows}, scores {tuple(step_scores.shape[1:])} on {device.type}"
            if device.type == "cuda":
                runner = capture_graph(_GateModule(self.pruner), tuple(flat), what, self._graphs.handle())
            else:
                config = f"{_source_digest()}|{key}|{self.pruner.config!r}"
                path = self.cache_dir / f"gate-{hashlib.sha256(config.encode()).hexdigest()[:24]}.pt2"
                runner = load_package(_GateModule(self.pruner), tuple(flat), path, what)
            self._runners[key] = runner
        confidence, go_on = runner(flat)
        return (confidence, go_on) if rows == bs else (confidence[:bs], go_on[:bs])


def load_package(module: torch.nn.Module, flat: tuple[torch.Tensor, ...], path: Path, what: str) -> Runner:
    """Load the AOTInductor package at ``path`` (building it from ``module`` traced on
    ``flat`` if it is missing), and check that it reproduces ``module`` on ``flat``.

    Returns a runner taking the flat input list. ``what`` names the module in logs and
    errors. Builds are atomic (concurrent ranks may build the same package), and the
    cache directory stays bounded (``MAX_PACKAGES``).
    """
    # Eager first: besides the reference, this fills the index-tensor caches
    # (``arange_cached`` and friends) with real tensors; tracing must not leave fake ones.
    with torch.inference_mode():
        expected = module(*flat)
    device = flat[0].device.type
    if not path.exists():
        log.info("compiling %s (once per shape, ~20-40 s on 2 cores)", what)
        start = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        exported = torch.export.export(module, flat, strict=False)
        fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
        os.close(fd)
        try:
            with torch._inductor.config.patch(_INDUCTOR_SETTINGS.get(device, {})):
                torch._inductor.aoti_compile_and_package(exported, package_path=tmp)
            os.replace(tmp, path)  # atomic: concurrent ranks may build the same package
        except Exception as exc:
            Path(tmp).unlink(missing_ok=True)
            raise CompileError(
                f"compiling {what} failed ({type(exc).__name__}: {exc}); AOTInductor needs a "
                "C++ compiler on CPU (apt-get install g++) and Triton on CUDA. "
                "Run without --compile-core to use the eager round."
            ) from exc
        log.info("compiled in %.0f s: %s", time.perf_counter() - start, path)
        _tidy(path.parent, keep=path)
    else:
        os.utime(path)  # recently used: the last to be evicted
    package_log = logging.getLogger("torch.export.pt2_archive._package")
    quiet = _HideIsaNote()
    package_log.addFilter(quiet)
    try:
        package = torch._inductor.aoti_load_package(str(path))
    finally:
        package_log.removeFilter(quiet)
    # The package's __call__ re-parses its pytree specs every call (tens of us); the
    # loader runs a flat tensor list directly, and the inputs here are flat already.
    loader = getattr(package, "loader", None)
    runner: Runner = loader.boxed_run if loader is not None else (lambda xs: package(*xs))
    with torch.inference_mode():
        got = runner(list(flat))
    if not _agrees(expected, got):
        raise CompileError(
            f"the compiled package {path} ({what}) disagrees with the eager round on its first inputs; "
            "delete the package to rebuild it, or run without --compile-core"
        )
    return runner


def _agrees(expected: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> bool:
    """Whether a compiled runner's outputs equal the eager module's, bit for bit."""
    return len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))


class GraphPool:
    """One CUDA graph memory pool, made on first use, shared by an owner's graphs (they
    never replay concurrently, so their intermediates may share memory)."""

    def __init__(self) -> None:
        self._handle: tuple[int, int] | None = None

    def handle(self) -> tuple[int, int]:
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle


def capture_graph(module: torch.nn.Module, flat: tuple[torch.Tensor, ...], what: str, pool: tuple[int, int]) -> Runner:
    """``module`` on ``flat``'s shapes, captured in a CUDA graph, and checked like a package.

    Returns a runner taking the flat input list: it copies the inputs into the graph's own
    buffers, replays, and returns copies of the outputs (the next replay overwrites the
    graph's). Raises ``CompileError`` when capturing fails or the replay does not equal
    the eager ``module`` on ``flat``.
    """
    # Normal (not inference) tensors, so that the buffers can be refilled in any grad mode.
    with torch.inference_mode(False), torch.no_grad():
        expected = module(*flat)  # the reference; it also fills the index caches outside the capture
        static_in = [t.clone() for t in flat]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            module(*static_in)  # warm-up on a side stream, as capturing asks
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                static_out = module(*static_in)
        except Exception as exc:
            raise CompileError(
                f"capturing {what} in a CUDA graph failed ({type(exc).__name__}: {exc}); "
                "run with the eager round instead (without --compile-core; in SGLang, --graft-eager-core)"
            ) from exc
    log.info("captured %s in a CUDA graph", what)

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        for buffer, x in zip(static_in, inputs):
            buffer.copy_(x)
        graph.replay()
        return [out.clone() for out in static_out]

    got = run(list(flat))
    if not _agrees(expected, got):
        raise CompileError(
            f"the CUDA graph of {what} disagrees with the eager module on its first inputs; run with the "
            "eager round instead (without --compile-core; in SGLang, --graft-eager-core) and report this"
        )
    return run
