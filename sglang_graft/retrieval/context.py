"""A request's own tokens, and the index of where its current suffix occurred before.

Repeated code blocks, copied spans and a prompt quoted back all show up as a suffix of
the sequence that already occurred earlier in it; what followed then is a cheap guess for
what follows now. ``ContextIndex`` finds those earlier occurrences the way LZ77
compressors do: hash chains over exact n-gram keys.

* ``head[key]`` is the latest position whose n-gram (the ``n`` tokens ending there) has
  that key; ``prev[i]`` is the previous position with the same n-gram as position ``i``.
  Appending a token is one dictionary update: O(1).
* A lookup walks at most ``max_chain`` links back from the current position, extends each
  hit backwards to its full match length (capped), and keeps the longest, most recent
  ones. The current longest match is also carried forward token by token while the
  sequence keeps copying it, so a long copy is never lost behind a busy n-gram chain.

Everything is bounded: a request keeps at most ``max_tokens`` tokens (when it grows past
that, the oldest half is dropped and the index rebuilt, amortised O(1) per token), and the
whole state is dropped when the request finishes or is aborted.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from sglang_graft.retrieval.continuations import Occurrence
from sglang_graft.retrieval.tokens import NgramKeys, common_suffix_length, dict_bytes


class TokenWindow:
    """The most recent ``max_tokens`` tokens of one request: its root and its suffix.

    Every source reads the root (the last token) from here; history lookups read the
    suffix; a finished request's window is what feeds the history index.
    """

    def __init__(self, tokens: array, max_tokens: int) -> None:
        if not tokens:
            raise ValueError("a request needs at least one token (the root of its first proposal)")
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = array("q")
        self.extend(tokens)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def extend(self, new: array) -> None:
        """Append tokens, dropping the oldest half of the window when it overflows."""
        self.tokens.extend(new)
        if len(self.tokens) > self.max_tokens:
            self.tokens = self.tokens[len(self.tokens) - self.max_tokens // 2 :]

    def occurrences(self, depth: int) -> list[Occurrence]:
        """A bare window indexes nothing, so it never proposes."""
        return []

    def occurrences_after(self, path: Sequence[int], depth: int, min_length: int) -> list[Occurrence]:
        """Nor does it continue a draft path."""
        return []

    def memory_bytes(self) -> int:
        return self.tokens.itemsize * len(self.tokens)


class ContextIndex(TokenWindow):
    """Suffix matches of one request against its own earlier tokens.

    Args:
        tokens: the prompt (at least one token, already range-checked).
        vocab_size: for exact n-gram keys.
        ngram: tokens a match needs before it is looked up (>= 1).
        max_match: match lengths are measured up to this cap (>= ngram).
        max_chain: chain links examined per lookup.
        max_occurrences: occurrences handed on per lookup (longest first, then latest).
        max_tokens: window bound, see ``TokenWindow``.
    """

    def __init__(
        self,
        tokens: array,
        *,
        vocab_size: int,
        ngram: int,
        max_match: int,
        max_chain: int,
        max_occurrences: int,
        max_tokens: int,
    ) -> None:
        if max_match < ngram:
            raise ValueError(f"max_match must be >= ngram ({ngram}), got {max_match}")
        if max_chain < 1 or max_occurrences < 1:
            raise ValueError(f"max_chain and max_occurrences must be >= 1, got {max_chain} and {max_occurrences}")
        self._keys = NgramKeys(ngram, vocab_size)
        self._max_match = max_match
        self._max_chain = max_chain
        self._max_occurrences = max_occurrences
        self._reset_index()
        super().__init__(tokens, max_tokens)

    def _reset_index(self) -> None:
        self._head: dict[int, int] = {}
        self._prev = array("q")
        self._key = 0
        self._best_end = -1  # end of the longest match carried forward (-1: search next time)
        self._best_len = 0

    def extend(self, new: array) -> None:
        """Append and index tokens: one dictionary update each, plus the carried match."""
        tokens, head, prev, keys = self.tokens, self._head, self._prev, self._keys
        n = keys.n
        key = self._key
        for t in new:
            i = len(tokens)
            if self._best_end >= 0:
                if tokens[self._best_end + 1] == t:
                    self._best_end += 1
                    self._best_len = min(self._best_len + 1, self._max_match)
                else:
                    self._best_end = -1
            tokens.append(t)
            key = keys.roll(key, t)
            if i >= n - 1:
                prev.append(head.get(key, -1))
                head[key] = i
            else:
                prev.append(-1)
        self._key = key
        if len(tokens) > self.max_tokens:
            kept = tokens[len(tokens) - self.max_tokens // 2 :]
            self.tokens = array("q")
            self._reset_index()
            self.extend(kept)

    def occurrences(self, depth: int) -> list[Occurrence]:
        """The longest (then latest) earlier matches of the current suffix, with ``depth`` tokens each."""
        tokens = self.tokens
        i = len(tokens) - 1
        if depth <= 0 or i < self._keys.n - 1:
            return []
        found = self._chain(tokens, i, self._prev[i])
        if self._best_end >= 0 and all(e != self._best_end for _, e in found):
            found.append((self._best_len, self._best_end))
        if not found:
            return []
        found = _longest_then_latest(found)[: self._max_occurrences]
        self._best_len, self._best_end = found[0]
        return [Occurrence(length, self._continuation(e, (), depth)) for length, e in found]

    def occurrences_after(self, path: Sequence[int], depth: int, min_length: int) -> list[Occurrence]:
        """``occurrences`` of the suffix the sequence would have after ``path`` (a drafted
        continuation of the current tokens), keeping matches of at least ``min_length``.

        This is what lets retrieval continue a draft path: at the start of a copied span
        the current suffix is new (its last token was just emitted), but a draft path that
        has begun the copy already matches it, so what followed the copy's source is its
        continuation. Nothing is indexed or carried forward: a path is only a guess.
        """
        tokens, keys = self.tokens, self._keys
        if depth <= 0 or not path or len(tokens) + len(path) < keys.n:
            return []
        key = self._key
        for t in path:
            key = keys.roll(key, t)
        # The suffix to match: enough real tokens for the longest match, then the path.
        suffix = tokens[-self._max_match :] + array("q", path)
        found = [f for f in self._chain(suffix, len(suffix) - 1, self._head.get(key, -1)) if f[0] >= min_length]
        found = _longest_then_latest(found)[: self._max_occurrences]
        return [Occurrence(length, self._continuation(e, path, depth)) for length, e in found]

    def _chain(self, suffix: array, last: int, end: int) -> list[tuple[int, int]]:
        """``(match length, end position)`` of the earlier positions on the hash chain from
        ``end``, at most ``max_chain`` links: how long ``suffix[: last + 1]`` matches there."""
        found: list[tuple[int, int]] = []
        for _ in range(self._max_chain):
            if end < 0:
                break
            found.append((common_suffix_length(suffix, last, self.tokens, end, self._keys.n, self._max_match), end))
            end = self._prev[end]
        return found

    def _continuation(self, end: int, path: Sequence[int], depth: int) -> array:
        """The ``depth`` tokens after position ``end`` of the sequence ``tokens + path``.

        A continuation that runs into the present repeats the span between the match and
        now: if the text keeps copying itself, that is exactly what comes next.
        """
        span = self.tokens[end + 1 : end + 1 + depth]
        if len(span) < depth and path:
            span.extend(path[: depth - len(span)])
        if len(span) < depth:
            span = (span * (depth // len(span) + 1))[:depth]
        return span

    def memory_bytes(self) -> int:
        """Tokens and chain links, plus the key dictionary (table and its int objects, estimated)."""
        return super().memory_bytes() + self._prev.itemsize * len(self._prev) + dict_bytes(self._head)


def _longest_then_latest(found: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(match length, end)`` pairs, longest match first, then latest."""
    return sorted(found, key=lambda f: (-f[0], -f[1]))
