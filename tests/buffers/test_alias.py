"""A kernel on one GPU reaching another GPU's imported pool (docs/decisions/0017): the importer
opens the handle a second time in the launching GPU's context, once, and closes every opening
with the mapping. The driver calls are replaced by a recorder, so this runs without a GPU; the
real thing runs in tests/gpu/test_gpu_transfer.py::test_cross_gpu_delta (2 GPUs)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from kvservice_client import cuda_ipc

from kvservice.buffers import memory
from kvservice.buffers.memory import MemoryImporter, alias_addresses
from kvservice.errors import InvalidArgument
from kvservice.kernels import KVRegions

ALLOC = 1 << 20


class Driver:
    """Stands in for cuIpcOpenMemHandle / cuIpcCloseMemHandle: each opening a fresh base."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.opened: list[tuple[bytes, int, int]] = []  # (handle, device, context)
        self.closed: list[tuple[int, int | None]] = []
        self.fail_on = fail_on
        self._next = 0x10_0000_0000

    def open_handle(self, handle: bytes, device: int, context: int | None = None) -> tuple[int, int]:
        ctx = device if context is None else context
        if ctx == self.fail_on:
            raise cuda_ipc.CudaError("cuIpcOpenMemHandle", 217)  # CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
        self.opened.append((handle, device, ctx))
        self._next += 0x1_0000_0000
        return self._next, device

    def close_handle(self, base: int, context: int | None = None) -> None:
        self.closed.append((base, context))


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Driver:
    d = Driver()
    monkeypatch.setattr(cuda_ipc, "open_handle", d.open_handle)
    monkeypatch.setattr(cuda_ipc, "close_handle", d.close_handle)
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    # the imported view is never touched here: skip torch's CUDA tensor construction
    monkeypatch.setattr(memory.torch, "as_tensor", lambda *a, **k: torch.empty(0, dtype=torch.uint8))
    return d


def region(handle: bytes, offset: int, size: int, device: int) -> types.SimpleNamespace:
    ipc = types.SimpleNamespace(
        handle=handle, offset=offset, allocation_size=ALLOC, device_uuid="", device_index=device
    )
    return types.SimpleNamespace(WhichOneof=lambda _: "cuda_ipc", cuda_ipc=ipc, size_bytes=size)


def test_second_opening_per_device_once_and_closed_with_the_mapping(driver: Driver) -> None:
    imp = MemoryImporter()
    h = bytes(range(64))
    a = imp.import_region("k[0]", region(h, 4096, 8192, device=1))
    b = imp.import_region("k[1]", region(h, 65536, 8192, device=1))  # same allocation: one opening
    assert len(driver.opened) == 1 and driver.opened[0][2] == 1
    own = 0x7000  # memory no importer holds (this process's own): unchanged
    out = alias_addresses([a.address, b.address, own], 0)
    assert out is not None and len(driver.opened) == 2 and driver.opened[1] == (h, 1, 0)
    alias_base = out[0] - 4096
    assert out == [alias_base + 4096, alias_base + 65536, own]
    assert alias_addresses([a.address], 0) == out[:1]  # cached: no third opening
    assert alias_addresses([a.address], 1) == [a.address]  # its own GPU: the first opening
    assert len(driver.opened) == 2
    imp.release(a)
    assert driver.closed == []  # b still holds the allocation
    imp.release(b)
    assert driver.closed == [(alias_base, 0), (a.address - 4096, 1)]  # both openings, each in its context
    assert imp.open_mappings == 0


def test_no_second_opening_means_no_alias(driver: Driver) -> None:
    driver.fail_on = 0
    imp = MemoryImporter()
    a = imp.import_region("k[0]", region(bytes(64), 0, 4096, device=1))
    assert alias_addresses([a.address], 0) is None  # the route falls back to the staged copy
    imp.release(a)
    assert driver.closed == [(a.address, 1)]


def test_aliased_regions_use_the_alias_addresses() -> None:
    k = [torch.zeros(4 * 16 * 2 * 8, dtype=torch.uint8) for _ in range(2)]
    v = [torch.zeros(4 * 16 * 2 * 8, dtype=torch.uint8) for _ in range(2)]
    r = KVRegions.create(k, v, page_size=16, num_heads=2, head_dim_k=4, itemsize=2)
    addrs = [0x1000 * (i + 1) for i in range(4)]  # staging order: K0, V0, K1, V1
    al = r.aliased(torch.device("cpu"), addrs)
    assert al.base_addresses.tolist() == addrs
    assert al.pointer_tables["k"].tolist() == [addrs[0], addrs[2]]
    assert al.pointer_tables["v"].tolist() == [addrs[1], addrs[3]]
    assert al.pointer_tables["all"].tolist() == addrs
    assert al.min_alignment == 16
    assert np.array_equal(r.base_addresses, [t.data_ptr() for t in r.regions])  # the original is as it was
    with pytest.raises(InvalidArgument, match="addresses"):
        r.aliased(torch.device("cpu"), addrs[:3])


def test_on_device_translates_once_per_device_and_retries_a_failure() -> None:
    k = [torch.zeros(4 * 16 * 2 * 8, dtype=torch.uint8) for _ in range(2)]
    r = KVRegions.create(k, None, page_size=16, num_heads=2, head_dim_k=4, itemsize=2)
    calls: list[int] = []
    answer: list[int] | None = None

    def translate(addresses: list[int], device: int) -> list[int] | None:
        calls.append(device)
        return answer

    dev = torch.device("cpu")
    assert r.on_device(dev, translate) is None and r.on_device(dev, translate) is None
    assert len(calls) == 2  # no mapping: asked again each time
    answer = [0x1000, 0x2000]
    first = r.on_device(dev, translate)
    assert first is not None and first.base_addresses.tolist() == answer
    assert r.on_device(dev, translate) is first and len(calls) == 3  # kept with the regions
