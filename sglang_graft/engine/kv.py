"""A batched, left-padded KV cache that speculative rounds can grow and compact.

Requests of a batch hold different numbers of verified tokens, and every round each one
keeps a different number of the tree nodes it just verified. Rather than one cache per
request, the whole batch shares one cache (``GrowingCache``) laid out left-padded:
row ``b``'s real tokens occupy the last ``lengths[b]`` columns, ``valid[b]`` marks them,
and every forward masks the padding out with an explicit 4D attention mask. Position ids
are passed explicitly, so padding never shifts a token's rotary position.

After a forward appended a block (a causal chunk, a draft level, a verify tree), ``commit``
keeps only the columns the caller names, re-packs every row right-aligned in place with
one batched gather per layer, and skips the leading columns that do not move (with one
request, or when all rows kept the same count, that is the whole old cache, so only the
new tail is touched).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from sglang_graft.engine.draft_head import decoder_logits

#: Most prompt tokens per prefill forward. Long blocks are slower per token on a CPU: the
#: MLP's elementwise work over ``tokens x intermediate`` activations falls out of cache. A
#: 708-token prompt prefilled the 1.5B target (intermediate 8960) in 2.77-2.84 s at once,
#: 2.25-2.53 s in chunks of 384, 2.66-2.72 s in chunks of 256 (2-core AMX Xeon, bf16).
PREFILL_CHUNK = 384
#: Spare room a ``GrowingLayer`` reserves when it must grow: an eighth of what it holds,
#: at least this many tokens, so re-copies are rare (amortised O(1) per token) and the
#: waste stays bounded (at most an eighth, or this many tokens).
GROW_MIN_TOKENS = 64


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends in place.

    transformers' ``DynamicLayer`` concatenates the whole cache with every forward's new
    keys and values, so every forward copies all of it (the 1.5B target over 700 cached
    tokens: 20 MB), and so did every compaction here. Appending in place took a 12-token
    verify and its compaction from 197 to 190 ms at 2000 cached tokens (177.5 to 177.1 at
    700), while one-token steps stayed within noise (93.6 and 91.9 ms at 700, 98.1 and
    99.0 at 2000; 2-core Zen 4 EPYC, bf16, medians of 11-15 interleaved reps): small, and
    growing with the context. This layer keeps its keys and values in buffers with
    spare room at the end (``GROW_MIN_TOKENS``) and exposes ``keys``/``values`` as views of
    their filled prefix; a forward writes its new columns into the room, and ``PaddedKV``
    compacts in place. Anything that replaces ``keys`` with a tensor that is not such a view
    (a cast, a row selection, transformers' own ``crop`` is still a view) is adopted as the
    new content at the next ``update``, which then copies it into a fresh buffer.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._holds(key_states, end):
            self._reserve(key_states, value_states, end)
        room_k, room_v = self._room
        room_k[:, :, length:end] = key_states
        room_v[:, :, length:end] = value_states
        self.keys, self.values = room_k[:, :, :end], room_v[:, :, :end]
        return self.keys, self.values

    def _holds(self, new: torch.Tensor, end: int) -> bool:
        """Whether ``keys``/``values`` are still prefixes of the buffers and ``end`` columns fit."""
        if self._room is None or end > self._room[0].shape[2]:
            return False
        room_k, room_v = self._room
        if self.keys.numel() == 0:
            return room_k.shape[:2] == new.shape[:2] and room_k.shape[3] == new.shape[3] and room_k.dtype == new.dtype
        # A tensor that starts where the buffer does, with its strides, is a prefix view
        # of it (the buffer is alive, so no other tensor can hold that address; views
        # made under inference mode do not record their base).
        return all(
            t.data_ptr() == room.data_ptr() and t.stride() == room.stride() and t.dtype == room.dtype
            for t, room in ((self.keys, room_k), (self.values, room_v))
        )

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        """New buffers for ``end`` columns plus spare room, holding the current content."""
        length = self.get_seq_length()
        capacity = end + max(GROW_MIN_TOKENS, end // 8)
        rooms = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            bs, heads, _, dim = new.shape
            room = torch.empty(bs, heads, capacity, dim, dtype=new.dtype, device=new.device)
            if length:
                room[:, :, :length] = old
            rooms.append(room)
        self._room = (rooms[0], rooms[1])


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` of ``GrowingLayer`` s (full-attention models)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


class PaddedKV:
    """The KV cache of one model for one batch of requests.

    Attributes:
        cache: the ``GrowingCache`` handed to the model (full-attention layers only).
        valid: ``[bs, L]`` bool, True on columns that hold a real token of that row.
        lengths: ``[bs]`` int64 real tokens per row, i.e. the next position id.
    """

    def __init__(self, batch_size: int, device: torch.device | str) -> None:
        self.cache = GrowingCache()
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def forward(
        self,
        model: torch.nn.Module,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_mask: torch.Tensor,
        prefix_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``model`` on a block of ``q`` new tokens per row and append their KV.

        Args:
            tokens: ``[bs, q]`` token ids.
            positions: ``[bs, q]`` position ids.
            block_mask: ``[bs, q, q]`` bool, which block tokens each block token sees.
            prefix_mask: ``[bs, q, L]`` bool over the cached columns (default: ``valid``).
            logits_to_keep: return logits for only the last that many tokens (0: all).
            head: maps the decoder's final hidden states to logits instead of the
                model's own LM head (``engine.draft_head.DraftHead``).

        The appended columns are marked invalid: the caller decides what survives through
        ``compact`` or ``commit``.
        """
        bs, q = tokens.shape
        if prefix_mask is None:
            prefix_mask = self.valid.unsqueeze(1).expand(bs, q, self.width)
        diag = torch.eye(q, dtype=torch.bool, device=tokens.device)
        allowed = torch.cat([prefix_mask, block_mask | diag], dim=2)
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=tokens.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        inputs = dict(
            input_ids=tokens,
            attention_mask=mask.unsqueeze(1),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
        )
        if head is None:
            logits = model(**inputs, logits_to_keep=logits_to_keep).logits
        else:
            logits = decoder_logits(model, head, logits_to_keep, **inputs)
        self.valid = torch.cat([self.valid, torch.zeros(bs, q, dtype=torch.bool, device=tokens.device)], dim=1)
        return logits

    def prefill(self, model: torch.nn.Module, tokens: torch.Tensor, valid: torch.Tensor, chunk: int = PREFILL_CHUNK) -> None:
        """Read a left-padded causal block (``valid`` marks the real tokens) after what the
        cache holds, ``chunk`` columns per forward, and keep it all. Only the KV is wanted,
        so the decoder runs without an LM head (the "head" hands back its hidden state)."""
        if chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1 tokens, got {chunk}")
        for start in range(0, tokens.shape[1], chunk):
            part, part_valid = tokens[:, start : start + chunk], valid[:, start : start + chunk]
            offsets, block = causal_block(part_valid)
            self.forward(model, part, self.lengths.unsqueeze(1) + offsets, block, logits_to_keep=1, head=_hidden)
            self.valid[:, self.width - part.shape[1] :] = part_valid
            self.lengths = self.lengths + part_valid.sum(dim=1)

    def cast(self, dtype: torch.dtype) -> None:
        """Hold the cached keys and values in ``dtype`` (for a forward by a model computing in it)."""
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.dtype != dtype:
                layer.keys = layer.keys.to(dtype)
                layer.values = layer.values.to(dtype)

    def commit(self, keep: torch.Tensor) -> None:
        """Keep exactly the columns ``keep`` ``[bs, L]`` (old valid ones and chosen new ones).

        Columns must be kept in order; the cache is re-packed right-aligned.
        """
        if keep.shape != self.valid.shape:
            raise ValueError(f"keep mask has shape {tuple(keep.shape)}, cache is {tuple(self.valid.shape)}")
        counts = keep.sum(dim=1)
        self.lengths = counts
        if bool(keep.all()):
            self.valid = keep.clone()
            return
        bs, width = keep.shape
        new_width = int(counts.max()) if bs else 0
        rank = keep.long().cumsum(dim=1) - 1
        dest = rank + (new_width - counts).unsqueeze(1)
        src = torch.arange(width, device=keep.device).expand(bs, width)
        index = torch.zeros(bs, new_width + 1, dtype=torch.int64, device=keep.device)
        index.scatter_(1, torch.where(keep, dest, new_width), src)
        index = index[:, :new_width]
        cols = torch.arange(new_width, device=keep.device)
        self.valid = cols.unsqueeze(0) >= (new_width - counts).unsqueeze(1)
        # Padding columns point at column 0 and are masked; leading columns that map to
        # themselves in every row need no copy.
        moved = ((index != cols) & self.valid).any(dim=0)
        still = int(moved.long().argmax()) if bool(moved.any()) else new_width
        self._gather(index[:, still:], still)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the requests ``rows`` (``[k]`` int64), then drop shared left padding."""
        self.valid = self.valid[rows]
        self.lengths = self.lengths[rows]
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys[rows]
                layer.values = layer.values[rows]
        if self.valid.shape[0] == 0 or self.width == 0:
            return
        pad = int((self.width - self.lengths).min())
        if pad > 0:
            self.valid = self.valid[:, pad:]
            for layer in self.cache.layers:
                if layer.is_initialized and layer.keys.numel():
                    layer.keys = layer.keys[:, :, pad:]
                    layer.values = layer.values[:, :, pad:]

    def _gather(self, index: torch.Tensor, start: int) -> None:
        """Layer by layer: columns ``[0, start)`` stay, the rest become ``index``'s columns."""
        bs, w = index.shape
        for layer in self.cache.layers:
            if not layer.is_initialized or layer.keys.numel() == 0:
                continue
            heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            idx = index.view(bs, 1, w, 1).expand(bs, heads, w, dim)
            # In place (a ``GrowingLayer`` keeps its buffers): gather reads every kept
            # column into a new tensor before the copy writes, so moves cannot clobber.
            for name in ("keys", "values"):
                full = getattr(layer, name)
                full[:, :, start : start + w] = full.gather(2, idx)
                setattr(layer, name, full[:, :, : start + w])


def _hidden(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def causal_block(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets and block mask for a left-padded causal chunk.

    Args:
        valid: ``[bs, q]`` bool, True on real tokens (padding on the left).

    Returns:
        ``offsets`` ``[bs, q]`` int64 (0 for the first real token; padding gets 0) and
        ``block_mask`` ``[bs, q, q]`` bool (causal, real columns only).
    """
    q = valid.shape[1]
    causal = torch.ones(q, q, dtype=torch.bool, device=valid.device).tril()
    offsets = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    return offsets, causal.unsqueeze(0) & valid.unsqueeze(1)


def left_pad(rows: list[list[int]], pad: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[bs, q]`` token tensor and validity mask from ragged lists, padded on the left."""
    width = max((len(r) for r in rows), default=0)
    tokens = torch.full((len(rows), width), pad, dtype=torch.int64)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            tokens[b, width - len(r) :] = torch.tensor(r, dtype=torch.int64)
            valid[b, width - len(r) :] = True
    return tokens.to(device), valid.to(device)
