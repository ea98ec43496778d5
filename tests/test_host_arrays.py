"""Host arrays shared with tensors, and the calibrator's host-loop update built on them."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_graft.calibration import AcceptanceCalibrator
from sglang_graft.host_arrays import shared_array


def test_shared_array_and_tensor_are_one_memory():
    buf, t = shared_array("i", 4, -1)
    assert t.dtype == torch.int32 and t.tolist() == [-1] * 4
    buf[2] = 7
    t[0] = 5
    assert t.tolist() == [5, -1, 7, -1] and buf.tolist() == [5, -1, 7, -1]
    with pytest.raises(BufferError):
        buf.append(1)  # resizing would leave the tensor dangling


@pytest.mark.parametrize("typecode, size", [("x", 4), ("d", 0)])
def test_shared_array_rejects_bad_arguments(typecode, size):
    with pytest.raises(ValueError, match="typecode|size"):
        shared_array(typecode, size, 0)


def test_observe_cells_equals_observe_bit_for_bit():
    rng = random.Random(0)
    by_tensor, by_cells = (AcceptanceCalibrator(3, 5, prior_strength=4.0, decay=0.97) for _ in range(2))
    for _ in range(30):
        n = rng.randrange(1, 12)
        groups = [rng.randrange(3) for _ in range(n)]
        bins = [rng.randrange(5) for _ in range(n)]
        accepted = [rng.random() < 0.4 for _ in range(n)]
        by_tensor.observe(torch.tensor(groups), torch.tensor(bins), torch.tensor(accepted))
        by_cells.observe_cells([g * 5 + b for g, b in zip(groups, bins)], accepted)
    assert torch.equal(by_cells.proposed, by_tensor.proposed)
    assert torch.equal(by_cells.accepted, by_tensor.accepted)
    assert by_cells.count_lists(7) == (by_tensor.proposed[:7].tolist(), by_tensor.accepted[:7].tolist())
    assert 0 < by_cells.proposed.sum() < 30 * 11  # decayed, not merely accumulated
    prior = torch.full((3,), 0.5)
    assert torch.equal(by_cells.estimate(1, torch.tensor([0, 2, 4]), prior), by_tensor.estimate(1, torch.tensor([0, 2, 4]), prior))


def test_observe_cells_needs_a_cpu_calibrator():
    with pytest.raises(RuntimeError, match="CPU"):
        AcceptanceCalibrator(2, 2, device="meta").observe_cells([0], [1])
