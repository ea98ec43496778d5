"""Tensors that share their memory with a Python ``array``.

On the CPU one tensor operation costs microseconds of dispatch however small its tensor,
while indexing an ``array`` from Python costs tens of nanoseconds. State that small host
loops touch one element at a time (the recycling table, calibration counts, per-source
counters) therefore keeps its storage in an ``array`` and exposes a tensor view of the
same memory: batched tensor code and host loops read and write one state, never a copy.
"""

from __future__ import annotations

from array import array

import torch

_DTYPES = {"i": torch.int32, "q": torch.int64, "f": torch.float32, "d": torch.float64}


def shared_array(typecode: str, size: int, fill: float) -> tuple[array, torch.Tensor]:
    """A ``size``-element ``array`` filled with ``fill`` and a 1-D CPU tensor over its memory.

    The tensor is made from a ``memoryview``, which it keeps alive: while the tensor
    exists the array is exporting its buffer, so resizing it (which would leave the
    tensor dangling) raises ``BufferError`` instead.
    """
    if typecode not in _DTYPES:
        raise ValueError(f"typecode must be one of {sorted(_DTYPES)}, got {typecode!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    buf = array(typecode, [fill]) * size
    assert buf.itemsize == _DTYPES[typecode].itemsize, "unexpected C type size for array typecode"
    return buf, torch.frombuffer(memoryview(buf), dtype=_DTYPES[typecode])
