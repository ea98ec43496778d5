"""Other requests' sequences, as a source of continuations for the current one.

Inside SGLang this mirrors what enters the shared radix prefix cache; outside it, the
finished requests of the reference engine. The index is keyed by cache namespace
(SGLang's ``extra_key``: LoRA id, ``cache_salt``; ``None`` is the default namespace): a
sequence inserted under one namespace is never proposed under another, because each
namespace has its own chain heads and a lookup only ever starts from its own.

Structure (the same hash chains as the context index, across sequences): each stored
sequence keeps its tokens and, per position, a link to the previous occurrence of the
n-gram ending there (packed as ``sequence_id << 32 | position``). Lookups walk at most
``max_chain`` links, so their cost does not grow with the history.

Bounds and eviction: at most ``max_tokens`` tokens are stored; inserting past that evicts
least-recently-used sequences first (a logical clock: insertion, re-insertion and being
proposed from all count as use; no wall time). An evicted sequence's chain heads are
handed to the next live occurrence; links from other sequences into it are detected as
dead (sequence ids are never reused) and end the walk there, so nothing dangles.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from sglang_graft.retrieval.continuations import Occurrence
from sglang_graft.retrieval.tokens import NgramKeys, TokenIds, common_suffix_length, dict_bytes, token_array

_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


@dataclass(eq=False)
class _Sequence:
    handle: int
    namespace: Hashable
    digest: bytes
    tokens: array
    prev: array  # packed link to the previous occurrence of the n-gram ending at each position, -1: none


@dataclass(eq=False)
class _Namespace:
    head: dict[int, int] = field(default_factory=dict)  # n-gram key -> packed latest occurrence
    by_digest: dict[bytes, int] = field(default_factory=dict)  # content digest -> handle
    num_sequences: int = 0


class HistoryIndex:
    """Bounded, namespaced store of token sequences with n-gram hash chains.

    Args:
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_tokens: token budget over all namespaces (>= 1, < 2**32).
        ngram: tokens of the current suffix a lookup keys on (>= 1).
        max_match: match lengths are measured up to this cap (>= ngram).
        max_chain: chain links examined per lookup.
        max_occurrences: occurrences handed on per lookup (longest first, then latest).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_tokens: int,
        ngram: int,
        max_match: int,
        max_chain: int,
        max_occurrences: int,
    ) -> None:
        if not 1 <= max_tokens < (1 << _POS_BITS):
            raise ValueError(f"history max_tokens must be in [1, {1 << _POS_BITS}), got {max_tokens}")
        if max_match < ngram:
            raise ValueError(f"max_match must be >= ngram ({ngram}), got {max_match}")
        if max_chain < 1 or max_occurrences < 1:
            raise ValueError(f"max_chain and max_occurrences must be >= 1, got {max_chain} and {max_occurrences}")
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self._keys = NgramKeys(ngram, vocab_size)
        self._max_match = max_match
        self._max_chain = max_chain
        self._max_occurrences = max_occurrences
        self._sequences: OrderedDict[int, _Sequence] = OrderedDict()  # least recently used first
        self._namespaces: dict[Hashable, _Namespace] = {}
        self._next_handle = 0
        self.num_tokens = 0
        self.num_evicted = 0

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def num_namespaces(self) -> int:
        return len(self._namespaces)

    def insert(self, namespace: Hashable, token_ids: TokenIds) -> int:
        """Store a sequence under ``namespace``; returns its handle (an int, never reused).

        Inserting the same tokens again under the same namespace only refreshes the
        existing copy and returns its handle. A sequence longer than the whole budget
        keeps its last ``max_tokens`` tokens.
        """
        tokens = token_array(token_ids, self.vocab_size, "history token_ids")
        if not tokens:
            raise ValueError("history token_ids is empty; insert needs at least one token")
        digest = _digest(tokens)
        space = self._find(namespace)
        handle = None if space is None else space.by_digest.get(digest)
        if handle is not None:
            self._sequences.move_to_end(handle)
            return handle
        if len(tokens) > self.max_tokens:
            tokens = tokens[len(tokens) - self.max_tokens :]
        while self.num_tokens + len(tokens) > self.max_tokens:
            self._drop(next(iter(self._sequences.values())))
            self.num_evicted += 1
        space = self._ensure(namespace)  # created after eviction, which may remove it
        handle = self._next_handle
        self._next_handle += 1
        seq = _Sequence(handle, namespace, digest, tokens, self._link(space, handle, tokens))
        self._sequences[handle] = seq
        space.by_digest[digest] = handle
        space.num_sequences += 1
        self.num_tokens += len(tokens)
        return handle

    def evict(self, namespace: Hashable, key: int | TokenIds) -> bool:
        """Remove a sequence, named by its handle or by its tokens; False if it is not stored.

        A handle that was stored under another namespace is a caller bug and raises.
        """
        space = self._find(namespace)
        if isinstance(key, int):
            seq = self._sequences.get(key)
            if seq is None:
                return False
            if space is None or seq.namespace != namespace:
                raise ValueError(f"history handle {key} belongs to namespace {seq.namespace!r}, not {namespace!r}")
        else:
            if space is None:
                return False
            handle = space.by_digest.get(_digest(token_array(key, self.vocab_size, "history token_ids")))
            if handle is None:
                return False
            seq = self._sequences[handle]
        self._drop(seq)
        return True

    def occurrences(self, namespace: Hashable, tokens: array, depth: int) -> list[Occurrence]:
        """Continuations of the suffix of ``tokens`` found in ``namespace``'s sequences.

        The sequences proposed from count as used for the LRU order.
        """
        space = self._find(namespace)
        keys = self._keys
        i = len(tokens) - 1
        if space is None or depth <= 0 or i < keys.n - 1:
            return []
        link = space.head.get(keys.at(tokens, i), -1)
        found: list[tuple[int, int, _Sequence, int]] = []  # (length, walk step, sequence, end)
        for step in range(self._max_chain):
            if link < 0:
                break
            seq = self._sequences.get(link >> _POS_BITS)
            if seq is None:  # the link outlived its sequence: the chain ends here
                break
            end = link & _POS_MASK
            if end + 1 < len(seq.tokens):
                length = common_suffix_length(tokens, i, seq.tokens, end, keys.n, self._max_match)
                found.append((length, step, seq, end))
            link = seq.prev[end]
        found.sort(key=lambda f: (-f[0], f[1]))
        out = []
        for length, _, seq, end in found[: self._max_occurrences]:
            self._sequences.move_to_end(seq.handle)
            out.append(Occurrence(length, seq.tokens[end + 1 : end + 1 + depth]))
        return out

    def memory_bytes(self) -> int:
        """Tokens and links of every sequence, plus the chain-head dictionaries (estimated)."""
        total = 0
        for seq in self._sequences.values():
            total += seq.tokens.itemsize * len(seq.tokens) + seq.prev.itemsize * len(seq.prev)
        for space in self._namespaces.values():
            total += dict_bytes(space.head) + dict_bytes(space.by_digest)
        return total

    def _find(self, namespace: Hashable) -> _Namespace | None:
        try:
            return self._namespaces.get(namespace)
        except TypeError:
            raise ValueError(f"history namespace must be hashable, got {type(namespace).__name__}") from None

    def _ensure(self, namespace: Hashable) -> _Namespace:
        space = self._find(namespace)
        if space is None:
            space = self._namespaces[namespace] = _Namespace()
        return space

    def _link(self, space: _Namespace, handle: int, tokens: array) -> array:
        """Chain every n-gram of a new sequence in front of the namespace's earlier ones."""
        keys, head = self._keys, space.head
        prev = array("q", [-1]) * len(tokens)
        key = 0
        base = handle << _POS_BITS
        for pos, t in enumerate(tokens):
            key = keys.roll(key, t)
            if pos >= keys.n - 1:
                prev[pos] = head.get(key, -1)
                head[key] = base | pos
        return prev

    def _drop(self, seq: _Sequence) -> None:
        """Forget a sequence and hand each chain head it held to the next live occurrence."""
        del self._sequences[seq.handle]
        space = self._namespaces[seq.namespace]
        del space.by_digest[seq.digest]
        space.num_sequences -= 1
        self.num_tokens -= len(seq.tokens)
        if space.num_sequences == 0:
            del self._namespaces[seq.namespace]
            return
        keys, head = self._keys, space.head
        base = seq.handle << _POS_BITS
        key = 0
        for pos, t in enumerate(seq.tokens):
            key = keys.roll(key, t)
            if pos < keys.n - 1 or head.get(key) != base | pos:
                continue
            link = seq.prev[pos]
            while link >= 0 and (link >> _POS_BITS) == seq.handle:
                link = seq.prev[link & _POS_MASK]
            if link >= 0 and (link >> _POS_BITS) in self._sequences:
                head[key] = link
            else:
                del head[key]


def _digest(tokens: array) -> bytes:
    """Content key of a sequence (process-independent, unlike Python's str hash)."""
    return hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()
