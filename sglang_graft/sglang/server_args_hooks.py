"""Graft's place in SGLang's launch: its flags, and the startup checks of a GRAFT launch.

Three hooks, all through SGLang's public plugin APIs:

* ``ServerArgs.add_cli_args`` (after): adds the ``--graft-*`` flags to SGLang's parser;
* ``ServerArgs.from_cli_args`` (after): parses them into ``GraftSettings`` and attaches
  them to the record (see ``settings``);
* the ``handle_speculative_decoding`` resolution step (``register_resolution_hook``):
  after SGLang's own step, a Graft launch gets the EAGLE-family defaults and checks
  (``_handle_eagle_family``, which SGLang runs only for its built-in algorithms), then
  Graft's own checks, each refusing a configuration Graft cannot run with a message that
  names the flag and the valid values.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from sglang_graft.sglang.settings import RECORD_ATTR, add_cli_args, settings_from_namespace, settings_of
from sglang_graft.sglang.spec_algo import ALGORITHMS, is_graft_algorithm


def add_graft_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    """After ``ServerArgs.add_cli_args(parser)``: add the ``--graft-*`` flags."""
    add_cli_args(parser)


def attach_graft_settings(server_args: Any, cls: type, args: argparse.Namespace) -> None:
    """After ``ServerArgs.from_cli_args(args)``: validate the flags and carry them on the record."""
    if hasattr(args, "graft_policy"):
        setattr(server_args, RECORD_ATTR, settings_from_namespace(args))


def resolve_graft_launch(server_args: Any, previous: Callable[[Any], None]) -> None:
    """The ``handle_speculative_decoding`` step, extended for Graft's algorithms."""
    previous(server_args)
    from sglang.srt.arg_groups.overrides import resolved_view, resolving_view

    if not is_graft_algorithm(resolving_view(server_args).speculative_algorithm):
        return
    from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family

    settings_of(server_args)  # settings given through SGLANG_GRAFT_ARGS are validated here too
    _handle_eagle_family(server_args)
    check_graft_launch(resolved_view(server_args))


def check_graft_launch(cfg: Any) -> None:
    """Raise ``ValueError`` for the first resolved setting a Graft launch cannot run with."""
    name = cfg.speculative_algorithm
    if name.upper() not in ALGORITHMS:
        raise ValueError(f"not a Graft algorithm: {name!r} (valid: {sorted(ALGORITHMS)})")
    if cfg.speculative_draft_model_path is None:
        what = "a plain draft LM with the target's vocabulary" if name == "GRAFT_STANDALONE" else "an EAGLE-3 draft head"
        raise ValueError(f"--speculative-algorithm {name} needs --speculative-draft-model-path ({what})")
    if cfg.speculative_eagle_topk is None or cfg.speculative_eagle_topk < 2:
        raise ValueError(
            f"--speculative-algorithm {name} needs --speculative-eagle-topk > 1 (got {cfg.speculative_eagle_topk}): "
            "with top-k 1 SGLang verifies a single chain (FA3 ignores the tree mask and the accepted path "
            "is not moved in the KV window), so a grafted tree cannot be verified"
        )
    if cfg.speculative_num_steps is None or cfg.speculative_num_steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1 for {name}, got {cfg.speculative_num_steps}")
    if cfg.speculative_num_draft_tokens is None or cfg.speculative_num_draft_tokens < 2:
        raise ValueError(
            f"--speculative-num-draft-tokens (the verify budget n, root included) must be >= 2 for {name}, "
            f"got {cfg.speculative_num_draft_tokens}"
        )
    for refused, message in _refusals(cfg, eagle3_draft=ALGORITHMS[name.upper()][0].draft_kind == "eagle3"):
        if refused:
            raise ValueError(f"--speculative-algorithm {name}: {message}")


def _refusals(cfg: Any, eagle3_draft: bool) -> list[tuple[bool, str]]:
    """Configurations Graft does not support, each with the reason and the fix."""
    from sglang.srt.runtime_context import attn_dp_enabled_of

    return [
        (
            not cfg.disable_overlap_schedule,
            "the overlap scheduler is not supported (retrieval reads each round's verified tokens on the "
            "host before the next draft); add --disable-overlap-schedule",
        ),
        (cfg.pp_size != 1, f"pipeline parallelism is not supported; use --pp-size 1 (got {cfg.pp_size})"),
        (attn_dp_enabled_of(cfg), "data-parallel attention is not supported; drop --attn-dp-size / --enable-dp-attention"),
        (
            cfg.disaggregation_mode != "null",
            f"PD disaggregation is not supported (got --disaggregation-mode {cfg.disaggregation_mode})",
        ),
        (cfg.enable_multi_layer_eagle, "--enable-multi-layer-eagle is not supported"),
        (
            cfg.speculative_use_rejection_sampling,
            "--speculative-use-rejection-sampling is not supported (it needs top-k 1; Graft verifies trees)",
        ),
        (
            eagle3_draft and cfg.enable_attn_tp_input_scattered,
            "--enable-attn-tp-input-scattered is not supported (SGLang disables it for EAGLE-3 aux "
            "hidden-state capture, which Graft's EAGLE-3 draft uses too)",
        ),
        (
            cfg.enable_amd_monokernel,
            "--enable-amd-monokernel is not supported (its feature probe recognises EAGLE-3 hidden-state "
            "capture only under the name EAGLE3)",
        ),
    ]
