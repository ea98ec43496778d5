"""Token-id checks, exact n-gram keys and suffix comparison shared by the host-side indexes.

The context and history indexes live on the host (they are dictionaries of positions),
so token sequences are kept as ``array('q')``: 8 bytes a token, C-speed slicing and
comparison, and no per-token Python objects.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import torch

#: A sequence of token ids as callers hand it over: a list, an array or a 1-D tensor.
TokenIds = Sequence[int] | torch.Tensor


def token_array(ids: TokenIds, vocab_size: int, what: str) -> array:
    """Copy ``ids`` into an ``array('q')``, raising ``ValueError`` on any id outside the vocabulary.

    Checking here, once per call, is what lets the hot paths index tables without bounds
    checks: a bad id would otherwise corrupt a shared structure silently.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{what} must hold integer token ids, got dtype {ids.dtype}")
        ids = ids.tolist()
    try:
        out = array("q", ids)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{what} must hold integer token ids in [0, {vocab_size}): {exc}") from None
    if out:
        check_id_range(what, min(out), max(out), vocab_size)
    return out


def check_integer_ids(what: str, ids: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``ids`` holds integers (not floats, not bools)."""
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"{what} must hold integer token ids, got dtype {ids.dtype}")


def check_id_range(what: str, lo: int, hi: int, vocab_size: int) -> None:
    """Raise ``ValueError`` unless ``[lo, hi]`` (the smallest and largest id) lies in the vocabulary."""
    if lo < 0:
        raise ValueError(f"{what} holds negative token id {lo}; valid ids are [0, {vocab_size})")
    if hi >= vocab_size:
        raise ValueError(f"{what} holds token id {hi}, outside the vocabulary [0, {vocab_size})")


def tensor_bounds(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``(min, max)`` of each non-empty tensor, read back with one host sync for all of them."""
    flat = torch.stack([v for t in tensors for v in torch.aminmax(t)]).tolist()
    return list(zip(flat[::2], flat[1::2]))


class NgramKeys:
    """Exact integer keys for the ``n`` tokens ending at a position.

    Each token takes ``bits`` bits of the key, so two different n-grams never share a key:
    lookups need no collision check, and no string hashing (whose seed varies between
    processes) is involved anywhere.
    """

    def __init__(self, n: int, vocab_size: int) -> None:
        if n < 1:
            raise ValueError(f"n-gram length must be >= 1, got {n}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.n = n
        self.bits = max(1, (vocab_size - 1).bit_length())
        self.mask = (1 << (self.bits * n)) - 1

    def roll(self, key: int, token: int) -> int:
        """The key after appending ``token`` to the n-gram whose key is ``key``."""
        return ((key << self.bits) | token) & self.mask

    def at(self, tokens: array, end: int) -> int:
        """Key of ``tokens[end - n + 1 : end + 1]`` (the caller ensures ``end >= n - 1``)."""
        key = 0
        for t in tokens[end - self.n + 1 : end + 1]:
            key = (key << self.bits) | t
        return key


_BLOCK = 8  # tokens compared per C-level slice comparison before going token by token


def common_suffix_length(x: array, a: int, y: array, b: int, known: int, cap: int) -> int:
    """Length of the longest common suffix of ``x[: a + 1]`` and ``y[: b + 1]``, at most ``cap``.

    ``known`` tokens are already known to match (the n-gram key did that; callers keep
    ``cap >= known``). Blocks of tokens are compared as slices, so a long match costs a
    few C-level comparisons.
    """
    n = known
    limit = min(cap, a + 1, b + 1)
    while n < limit:
        step = min(_BLOCK, limit - n)
        if x[a - n - step + 1 : a - n + 1] == y[b - n - step + 1 : b - n + 1]:
            n += step
            continue
        while x[a - n] == y[b - n]:
            n += 1
        return n
    return limit


def dict_bytes(d: dict[Any, Any]) -> int:
    """Approximate footprint of a dict of small keys and values: its table plus ~32 bytes per object."""
    return d.__sizeof__() + 64 * len(d)
