"""``sglang-graft serve``: start SGLang's server with Graft switched on.

A thin wrapper: it checks that this host can run SGLang at all (sglang installed, a CUDA
GPU visible), fills in Graft's defaults for the flags the user did not give, and hands
every argument to ``python -m sglang.launch_server`` unchanged. The plugin itself is
loaded by SGLang through its ``sglang.srt.plugins`` entry point, in the launcher and in
every scheduler subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable, Sequence

#: Flags filled in when absent: Graft's tree needs topk > 1 (see DESIGN.md section 4), the
#: budget and depth follow SGLang's usual EAGLE-3 settings for large models, and the plugin
#: refuses the overlap scheduler (its tree depends on the previous round's verify outcome).
GRAFT_DEFAULTS: tuple[tuple[str, str | None], ...] = (
    ("--speculative-algorithm", "GRAFT"),
    ("--speculative-num-steps", "5"),
    ("--speculative-eagle-topk", "4"),
    ("--speculative-num-draft-tokens", "16"),
    ("--disable-overlap-schedule", None),
)

CPU_HINT = (
    "On a machine without a GPU, run the reference engine instead, e.g.\n"
    "  sglang-graft generate --target tiny --draft tiny --prompt 'def fib(n):'\n"
    "or with real weights: sglang-graft generate --target PATH --draft PATH --prompt TEXT"
)


class ServeUnavailable(RuntimeError):
    """This host cannot start SGLang; the message says why and what to do instead."""


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def with_graft_defaults(args: Sequence[str]) -> list[str]:
    """``args`` plus each Graft default whose flag is not already present."""
    out = list(args)
    for flag, value in GRAFT_DEFAULTS:
        if not _given(out, flag):
            out += [flag] if value is None else [flag, value]
    return out


def check_host(
    has_module: Callable[[str], bool] = lambda name: importlib.util.find_spec(name) is not None,
    cuda_available: Callable[[], bool] | None = None,
) -> None:
    """Raise ``ServeUnavailable`` unless sglang is installed and a CUDA GPU is visible."""
    if not has_module("sglang"):
        raise ServeUnavailable(
            "sglang is not installed. On a GPU host: pip install 'sglang-graft[sglang]' "
            "(or use the Docker image, see README).\n" + CPU_HINT
        )
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available
    if not cuda_available():
        raise ServeUnavailable("no CUDA GPU is visible, and SGLang's kernels need one.\n" + CPU_HINT)


def serve_command(args: Sequence[str]) -> list[str]:
    """The full command line ``serve`` runs."""
    if not _given(args, "--model-path") and not _given(args, "--model"):
        raise ValueError("serve needs --model-path MODEL (the target), e.g. --model-path Qwen/Qwen3-8B")
    return [sys.executable, "-m", "sglang.launch_server", *with_graft_defaults(args)]


def serve(args: Sequence[str]) -> None:
    """Check the host, then replace this process with SGLang's server."""
    cmd = serve_command(args)
    check_host()
    print("[sglang-graft] " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
