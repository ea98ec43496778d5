"""The entry point SGLang's plugin loader calls: ``register()``.

SGLang calls ``load_plugins()`` in the launcher before parsing the command line and again
in every scheduler subprocess, so ``register`` runs once per process and must be cheap
and idempotent: it checks the SGLang version, registers Graft's algorithms and hooks, and
imports only modules the launcher has already loaded. The radix-cache hooks are installed
later, by the worker, only in the scheduler processes of a Graft launch (see
``radix_feed``), because importing the cache modules costs seconds at every launch.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable

from sglang_graft.sglang.version import check_sglang_version

logger = logging.getLogger(__name__)

#: ``(dotted target, hook, hook type name)`` registered through SGLang's ``HookRegistry``.
HOOKS: tuple[tuple[str, str, str], ...] = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "add_graft_cli_args", "AFTER"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", "attach_graft_settings", "AFTER"),
)
#: ``(resolution step name, hook)`` registered through ``register_resolution_hook``.
RESOLUTION_HOOKS: tuple[tuple[str, str], ...] = (("handle_speculative_decoding", "resolve_graft_launch"),)

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register Graft with SGLang (the ``sglang.srt.plugins`` entry point). Idempotent."""
    global _registered
    with _lock:
        if _registered:
            return
        version = check_sglang_version()
        _register_algorithms()
        _register_hooks()
        _registered = True
    logger.info("sglang-graft registered GRAFT and GRAFT_STANDALONE on sglang %s", version)


def _register_algorithms() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_graft.sglang.spec_algo import ALGORITHMS

    for name, (spec_class, factory) in ALGORITHMS.items():
        existing = get_spec(name)
        if existing is not None:
            if not isinstance(existing, spec_class):
                raise RuntimeError(f"speculative algorithm {name} is already registered by another plugin: {existing!r}")
            continue
        # Overlap scheduling is refused at startup (server_args_hooks) with a clearer message.
        SpeculativeAlgorithm.register(name, supports_overlap=False, spec_class=spec_class)(factory)


def _register_hooks() -> None:
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS, register_resolution_hook
    from sglang.srt.plugins.hook_registry import _current_plugin_source

    from sglang_graft.sglang import server_args_hooks

    # Inside load_plugins the loader applies every plugin's hooks once all have registered
    # (applying early would lock out later plugins' hooks on the same targets). Called
    # directly, nothing else would apply them.
    add_hooks(
        [(target, getattr(server_args_hooks, name), kind) for target, name, kind in HOOKS],
        apply=_current_plugin_source.get() is None,
    )
    for step, hook_name in RESOLUTION_HOOKS:
        hook = getattr(server_args_hooks, hook_name)
        if hook not in _HOOKS.get(step, ()):
            register_resolution_hook(step)(hook)


def add_hooks(hooks: Iterable[tuple[str, Callable, str]], apply: bool = True) -> None:
    """Register ``(dotted target, hook, HookType name)`` with SGLang's ``HookRegistry``,
    skipping hooks already registered on their target, then apply them if asked.

    Used at plugin load and by the worker for hooks needed only in a Graft launch's
    scheduler processes. Applying is idempotent (SGLang skips patched targets).
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in hooks:
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType[kind])
    if apply:
        HookRegistry.apply_hooks()
