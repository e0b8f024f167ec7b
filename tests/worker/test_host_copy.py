"""A step's small host arrays go to the device as one packed transfer (host_copy.to_device_many)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.worker.host_copy import pack, to_device_many, unpack

ITEMS = [([3, -1, 2**40], torch.int64), ([], torch.int32), ([7], torch.int32),
         ([[1, 2, 3], [4, 5, 6]], torch.int32), ([0.5, -2.25], torch.float32), ([9, 8], torch.int64)]


def _check(got: list[torch.Tensor], device: torch.device) -> None:
    assert len(got) == len(ITEMS)
    for t, (data, dtype) in zip(got, ITEMS):
        want = torch.tensor(data, dtype=dtype)
        assert t.device.type == device.type and t.dtype == dtype and t.shape == want.shape
        assert torch.equal(t.cpu(), want)


def test_pack_unpack_round_trip_keeps_values_dtypes_and_shapes() -> None:
    host = [torch.tensor(d, dtype=dt) for d, dt in ITEMS]
    buf, offsets = pack(host)
    assert buf.dtype == torch.uint8 and all(off % 8 == 0 for off in offsets)
    assert len(set(offsets)) == len(offsets) - 1  # only the empty array shares its start
    _check(unpack(buf, host, offsets), torch.device("cpu"))


def test_cpu_device_gets_plain_tensors() -> None:
    _check(to_device_many(ITEMS, torch.device("cpu")), torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_one_packed_copy_to_the_gpu() -> None:
    got = to_device_many(ITEMS, torch.device("cuda"))
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1  # views of one device buffer
    _check(got, torch.device("cuda"))
