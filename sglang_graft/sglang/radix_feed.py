"""Feed the history index from SGLang's radix cache, and follow its evictions.

What the radix cache holds is exactly the set of sequences other requests may share, so
the history index mirrors it: every cache ``insert`` stores the inserted token sequence
under its namespace (``extra_key``, ``cache_salt``: LoRA adapter and cache salt, so
retrieval never crosses them), and when the cache drops the node a sequence ends at, the
sequence leaves the history too. A sequence that ends inside a longer cached one is
redundant (the longer one holds every token), so it is not stored, and storing a longer
one drops the stored prefixes on its path.

Following evictions needs node objects: SGLang's Python ``RadixCache`` and the unified
cache's Python tree core (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``). The default
Rust tree core exposes only node ids, so under it sequences are still fed and the history
index's own LRU token bound (``--graft-history-max-tokens``) does the evicting.

Hooks are installed by the worker of a Graft launch only (the cache modules are too
heavy to import at every launch) and do nothing until a feed is attached. Each
tensor-parallel rank holds its own cache replica, which SGLang keeps identical, so each
rank's history is identical too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any, Protocol

from sglang_graft.sglang.request_sync import namespace_of

logger = logging.getLogger(__name__)

#: ``(dotted target, hook name)``, all ``AFTER`` hooks through SGLang's ``HookRegistry``.
RADIX_HOOKS: tuple[tuple[str, str], ...] = (
    ("sglang.srt.mem_cache.radix_cache.RadixCache.insert", "_after_radix_insert"),
    ("sglang.srt.mem_cache.radix_cache.RadixCache._delete_leaf", "_after_node_removed"),
    ("sglang.srt.mem_cache.radix_cache.RadixCache.reset", "_after_reset"),
    ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert", "_after_unified_insert"),
    ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.reset", "_after_reset"),
    ("sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore._unregister_node", "_after_node_removed"),
)


class HistoryLike(Protocol):
    def insert(self, namespace: Hashable, token_ids: Any) -> int: ...

    def evict(self, namespace: Hashable, key: Any) -> bool: ...


class RadixHistoryFeed:
    """Mirrors radix-cache sequences into a history index (see the module docstring)."""

    def __init__(self, history: HistoryLike) -> None:
        self.history = history
        self._by_node: dict[int, list[tuple[Hashable, int]]] = {}  # end node id -> stored sequences

    @property
    def tracked_nodes(self) -> int:
        return len(self._by_node)

    def inserted(self, key: Any, end_node: Any | None) -> None:
        """A cache insert of ``key`` (a ``RadixKey``) that ended at ``end_node`` (None: unknown)."""
        tokens = key.raw_token_ids()
        if len(tokens) == 0:
            return
        if end_node is not None and _has_live_children(end_node):
            return  # ends inside a longer cached sequence, which already holds these tokens
        namespace = namespace_of(key.extra_key, key.cache_salt)
        handle = self.history.insert(namespace, tokens)
        if end_node is None:
            return
        parent = getattr(end_node, "parent", None)
        while parent is not None:
            self.removed(parent)  # stored prefixes of this sequence are now redundant
            parent = getattr(parent, "parent", None)
        entries = self._by_node.setdefault(end_node.id, [])
        if (namespace, handle) not in entries:
            entries.append((namespace, handle))

    def removed(self, node: Any) -> None:
        """The cache dropped ``node``: sequences ending there leave the history."""
        for namespace, handle in self._by_node.pop(node.id, ()):
            self.history.evict(namespace, handle)

    def cleared(self) -> None:
        """The cache was flushed: every tracked sequence leaves the history."""
        for entries in self._by_node.values():
            for namespace, handle in entries:
                self.history.evict(namespace, handle)
        self._by_node.clear()


def _has_live_children(node: Any) -> bool:
    children = getattr(node, "children", None)
    return bool(children) and any(getattr(c, "value", True) is not None for c in children.values())


_lock = threading.Lock()
_active: RadixHistoryFeed | None = None


def install(history: HistoryLike) -> RadixHistoryFeed:
    """Attach a feed for ``history`` (replacing any previous one) and install the hooks once."""
    global _active
    from sglang_graft.sglang.plugin import add_hooks

    with _lock:
        add_hooks((target, globals()[name], "AFTER") for target, name in RADIX_HOOKS)
        _active = RadixHistoryFeed(history)
    logger.info("sglang-graft: history index fed from the radix cache")
    return _active


def detach() -> None:
    """Stop feeding (the hooks stay installed and do nothing)."""
    global _active
    _active = None


def _after_radix_insert(result: Any, cache: Any, params: Any, *args: Any, **kwargs: Any) -> None:
    if _active is not None and params.key is not None and not cache.disable:
        _active.inserted(params.key, result.last_device_node)


def _after_unified_insert(result: Any, cache: Any, params: Any, *args: Any, **kwargs: Any) -> None:
    if _active is None or params.key is None or cache.disable:
        return
    node_by_id = getattr(cache.tree_core, "node_by_id", None)  # Python tree core only
    node = node_by_id(result.last_device_node) if node_by_id is not None else None
    _active.inserted(params.key, node)


def _after_node_removed(result: Any, owner: Any, node: Any, *args: Any, **kwargs: Any) -> None:
    if _active is not None:
        _active.removed(node)


def _after_reset(result: Any, cache: Any, *args: Any, **kwargs: Any) -> None:
    if _active is not None:
        _active.cleared()
