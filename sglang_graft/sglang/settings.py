"""Graft's launch settings: ``--graft-*`` flags in SGLang's style, parsed and validated once.

SGLang's ``ServerArgs`` is a closed record (no plugin fields), so the flags are added to
SGLang's argument parser by a hook and the parsed ``GraftSettings`` rides on the record
as bookkeeping (``server_args._graft_settings``), which SGLang pickles into every
scheduler subprocess. Launches that build ``ServerArgs`` in Python (``sglang.Engine``)
pass the same flags in the ``SGLANG_GRAFT_ARGS`` environment variable.

The verify budget ``n`` is SGLang's own ``--speculative-num-draft-tokens``; the draft
shape is ``--speculative-num-steps`` and ``--speculative-eagle-topk``.
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_graft.prune import GATE_MODES, GateConfig
from sglang_graft.scheduler import POLICIES, SchedulerConfig

#: Retrieval sources that can be switched on and off, as spelled on the command line.
SOURCE_FLAGS: tuple[str, ...] = ("recycling", "context", "history")
#: Environment variable holding ``--graft-*`` flags for launches without a command line.
ENV_ARGS = "SGLANG_GRAFT_ARGS"
#: Attribute of the ``ServerArgs`` record that carries the parsed settings.
RECORD_ATTR = "_graft_settings"


@dataclass(frozen=True)
class GraftSettings:
    """Everything Graft reads at startup.

    Attributes:
        policy: ``graft`` (prune, then retrieve into the freed slots), ``pruned`` (prune
            only), ``dense`` (plain EAGLE tree, for A/B runs), ``retrieval`` (no draft nodes).
        gates: confidence gates (mode, thresholds, node floor).
        sources: enabled retrieval sources, a subset of ``SOURCE_FLAGS`` in that order.
        history_max_tokens: token bound of the shared history index (LRU beyond it).
        log_interval: verify rounds between per-source acceptance log lines (0: never).
        eager_core: on CUDA, build each round's tree with eager ops instead of replaying
            it from a CUDA graph (one graph per batch and width bucket, captured on first
            use); for debugging, the trees are the same.
    """

    policy: str = "graft"
    gates: GateConfig = field(default_factory=GateConfig)
    sources: tuple[str, ...] = SOURCE_FLAGS
    history_max_tokens: int = 1 << 22
    log_interval: int = 200
    eager_core: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--graft-policy must be one of {POLICIES}, got {self.policy!r}")
        unknown = [s for s in self.sources if s not in SOURCE_FLAGS]
        if unknown:
            raise ValueError(f"--graft-sources: unknown source(s) {unknown}; valid names are {SOURCE_FLAGS}")
        if self.history_max_tokens < 1:
            raise ValueError(f"--graft-history-max-tokens must be >= 1, got {self.history_max_tokens}")
        if self.log_interval < 0:
            raise ValueError(f"--graft-log-interval must be >= 0 (0 disables), got {self.log_interval}")
        if self.policy in ("graft", "retrieval") and not self.sources:
            raise ValueError(f"--graft-policy {self.policy} needs at least one of --graft-sources {SOURCE_FLAGS}")

    def scheduler_config(self, num_nodes: int, device: torch.device | str = "cpu") -> SchedulerConfig:
        """The core scheduler's settings for a verify budget of ``num_nodes`` (root included)
        on ``device`` (CUDA graphs of the round there, unless ``eager_core``)."""
        graphed = torch.device(device).type == "cuda" and not self.eager_core
        return SchedulerConfig(policy=self.policy, num_nodes=num_nodes, gates=self.gates, compile_core=graphed)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--graft-*`` flags (strings are validated by ``settings_from_namespace``)."""
    d = GraftSettings()
    g = parser.add_argument_group("Graft speculative decoding (sglang-graft; --speculative-algorithm GRAFT)")
    g.add_argument("--graft-policy", type=str, choices=POLICIES, default=d.policy,
                   help="How the verify tree is built: prune then graft retrieval (graft), prune only, "
                        "the dense EAGLE tree, or retrieval only.")
    g.add_argument("--graft-gate-mode", type=str, choices=GATE_MODES, default=d.gates.mode,
                   help="Confidence gates on raw draft probabilities (fixed) or on online-calibrated "
                        "acceptance estimates (online).")
    g.add_argument("--graft-root-threshold", type=float, default=d.gates.root_threshold,
                   help="Draft no deeper than depth 1 when the best depth-1 score is below this.")
    g.add_argument("--graft-depth-thresholds", type=str, default=_format_thresholds(d.gates.depth_thresholds),
                   help="Depth gates as DEPTH:THRESHOLD pairs, comma separated (e.g. 1:0.2,4:0.3); "
                        "'none' for no depth gate.")
    g.add_argument("--graft-min-node-score", type=float, default=d.gates.min_node_score,
                   help="Drop draft nodes whose path score is below this, freeing slots for retrieval.")
    g.add_argument("--graft-sources", type=str, default=",".join(d.sources),
                   help=f"Retrieval sources to use, comma separated, from {','.join(SOURCE_FLAGS)}; 'none' for none.")
    g.add_argument("--graft-history-max-tokens", type=int, default=d.history_max_tokens,
                   help="Token bound of the history index fed from the radix cache (LRU eviction beyond it).")
    g.add_argument("--graft-log-interval", type=int, default=d.log_interval,
                   help="Verify rounds between log lines of accepted tokens per source (0: never).")
    g.add_argument("--graft-eager-core", action="store_true",
                   help="Build each round's tree with eager PyTorch ops instead of replaying it from a "
                        "CUDA graph (for debugging; the trees are the same).")


def settings_from_namespace(ns: argparse.Namespace | Any) -> GraftSettings:
    """Build validated settings from parsed flags; raise ``ValueError`` naming the bad flag."""
    thresholds = _parse_thresholds(ns.graft_depth_thresholds)
    try:
        gates = GateConfig(
            mode=ns.graft_gate_mode,
            root_threshold=ns.graft_root_threshold,
            depth_thresholds=thresholds,
            min_node_score=ns.graft_min_node_score,
        )
    except ValueError as e:
        raise ValueError(f"--graft-gate-mode/--graft-*-threshold(s)/--graft-min-node-score: {e}") from None
    return GraftSettings(
        policy=ns.graft_policy,
        gates=gates,
        sources=_parse_sources(ns.graft_sources),
        history_max_tokens=ns.graft_history_max_tokens,
        log_interval=ns.graft_log_interval,
        eager_core=ns.graft_eager_core,
    )


def parse_flags(argv: list[str]) -> GraftSettings:
    """Settings from a list of ``--graft-*`` flags only (the ``SGLANG_GRAFT_ARGS`` form)."""
    parser = argparse.ArgumentParser(prog=ENV_ARGS, add_help=False, exit_on_error=False)
    add_cli_args(parser)
    try:
        ns, rest = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(f"{ENV_ARGS}: {e}") from None
    if rest:
        raise ValueError(f"{ENV_ARGS} holds arguments that are not --graft-* flags: {rest}")
    return settings_from_namespace(ns)


def settings_of(server_args: Any) -> GraftSettings:
    """The settings of a launch: from its command line, else ``SGLANG_GRAFT_ARGS``, else defaults."""
    attached = getattr(server_args, RECORD_ATTR, None)
    if attached is not None:
        return attached
    return parse_flags(shlex.split(os.environ.get(ENV_ARGS, "")))


def _parse_thresholds(text: str) -> tuple[tuple[int, float], ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    pairs = []
    for item in text.split(","):
        depth, sep, threshold = item.partition(":")
        try:
            if not sep:
                raise ValueError
            pairs.append((int(depth), float(threshold)))
        except ValueError:
            raise ValueError(
                f"--graft-depth-thresholds: {item!r} is not DEPTH:THRESHOLD (e.g. 1:0.2,4:0.3)"
            ) from None
    return tuple(pairs)


def _format_thresholds(pairs: tuple[tuple[int, float], ...]) -> str:
    return ",".join(f"{d}:{t}" for d, t in pairs) or "none"


def _parse_sources(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    names = [s.strip().lower() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SOURCE_FLAGS]
    if unknown:
        raise ValueError(f"--graft-sources: unknown source(s) {unknown}; valid names are {SOURCE_FLAGS}")
    return tuple(s for s in SOURCE_FLAGS if s in names)
