"""Memory regions an engine hands to the service, and a shared-memory KV pool for CPU engines.

A region names memory, never a pointer the service must trust: POSIX shared memory by name (+
offset) or a CUDA IPC handle (+ offset into the exported allocation).
"""

from __future__ import annotations

import dataclasses
import secrets
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from ._layout import Layout
from ._proto import common_pb2

__all__ = ["AuxSpec", "Region", "ShmKVPool", "cuda_region", "pointer_region", "shm_region"]

_DEV_SHM = "/dev/shm/"


@dataclasses.dataclass(frozen=True)
class Region:
    """One contiguous region: exactly one of ``shm_name`` or ``cuda_handle`` is set."""

    size_bytes: int
    shm_name: str = ""
    offset: int = 0
    cuda_handle: bytes = b""
    allocation_size: int = 0
    device_index: int = 0
    device_uuid: str = ""

    def to_proto(self) -> common_pb2.Region:
        if self.cuda_handle:
            return common_pb2.Region(
                cuda_ipc=common_pb2.CudaIpcMemory(
                    handle=self.cuda_handle,
                    offset=self.offset,
                    allocation_size=self.allocation_size,
                    device_index=self.device_index,
                    device_uuid=self.device_uuid,
                ),
                size_bytes=self.size_bytes,
            )
        return common_pb2.Region(
            shm=common_pb2.ShmMemory(name=self.shm_name, offset=self.offset),
            size_bytes=self.size_bytes,
        )


@dataclasses.dataclass(frozen=True)
class AuxSpec:
    """An aux region: ``num_rows`` rows of ``row_bytes`` in ``region``."""

    name: str
    region: Region
    row_bytes: int
    num_rows: int

    def to_proto(self) -> common_pb2.AuxRegion:
        return common_pb2.AuxRegion(
            name=self.name,
            region=self.region.to_proto(),
            row_bytes=self.row_bytes,
            num_rows=self.num_rows,
        )


def shm_region(name: str, size_bytes: int, offset: int = 0) -> Region:
    return Region(size_bytes=size_bytes, shm_name=name, offset=offset)


def cuda_region(tensor: Any) -> Region:
    """Region of a contiguous CUDA tensor (which may sit at an offset inside a larger block)."""
    from .cuda_ipc import tensor_export

    return _exported(tensor_export(tensor), tensor.numel() * tensor.element_size())


def pointer_region(ptr: int, nbytes: int, device_index: int = 0) -> Region:
    """Region of ``[ptr, ptr + nbytes)`` of this process, for engines that hand out raw pointers:
    the POSIX shared-memory object it lies in (found in ``/proc/self/maps``), or the CUDA
    allocation holding it (an IPC handle and the offset inside). Other memory (plain malloc)
    cannot be opened by the service: ValueError says so."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                path = parts[5].strip() if len(parts) > 5 else ""
                if path.startswith(_DEV_SHM) and ptr + nbytes <= hi:
                    return shm_region(path[len(_DEV_SHM) :], nbytes, int(parts[2], 16) + ptr - lo)
                break
    try:
        from .cuda_ipc import CudaError, export_pointer

        return _exported(export_pointer(ptr, device_index), nbytes)
    except (CudaError, OSError):  # no CUDA here, or not device memory
        pass
    raise ValueError(
        f"0x{ptr:x} (+{nbytes} bytes) is neither in a POSIX shared-memory object nor CUDA memory; "
        "kvservice cannot map it (host memory must be allocated in /dev/shm)"
    )


def _exported(exp: Any, nbytes: int) -> Region:
    return Region(
        size_bytes=nbytes,
        offset=exp.offset,
        cuda_handle=exp.handle,
        allocation_size=exp.allocation_size,
        device_index=exp.device_index,
        device_uuid=exp.device_uuid,
    )


class ShmKVPool:
    """A KV pool in one POSIX shared-memory object, for CPU engines, tests and the demo.

    Object layout (each region 64-byte aligned)::

        [k0][k1]...[k(L-1)][v0]...[v(L-1)][aux0][aux1]...

    ``k(l)``/``v(l)`` are uint8 views ``[num_pages, page_bytes]`` (``hnd_kv``: ``k(l)`` holds a
    page's K and V, there is no ``v``); the creator owns (and unlinks)
    the object, ``attach`` maps an existing one.
    """

    def __init__(
        self, layout: Layout, shm: shared_memory.SharedMemory, aux: dict[str, tuple[int, int]], owner: bool
    ) -> None:
        self.layout = layout
        self._shm = shm
        self._owner = owner
        self.name = shm.name
        k, v = layout.region_bytes_k, layout.region_bytes_v
        offsets, pos = [], 0
        for size in [k] * layout.num_layers + [v] * layout.num_v_regions:
            offsets.append((pos, size))
            pos = _align(pos + size)
        self._kv = offsets
        self._aux: dict[str, tuple[int, int, int]] = {}
        for aname, (row_bytes, rows) in aux.items():
            self._aux[aname] = (pos, row_bytes, rows)
            pos = _align(pos + row_bytes * rows)
        self.nbytes = pos

    @classmethod
    def create(
        cls, layout: Layout, aux: dict[str, tuple[int, int]] | None = None, name: str | None = None
    ) -> ShmKVPool:
        """Allocate a zeroed pool; ``aux`` maps name -> (row_bytes, num_rows)."""
        aux = aux or {}
        size = _pool_bytes(layout, aux)
        shm = shared_memory.SharedMemory(name=name or f"kv-{secrets.token_hex(6)}", create=True, size=size)
        return cls(layout, shm, aux, owner=True)

    @classmethod
    def attach(cls, name: str, layout: Layout, aux: dict[str, tuple[int, int]] | None = None) -> ShmKVPool:
        shm = _attach_untracked(name)
        return cls(layout, shm, aux or {}, owner=False)

    def _view(self, offset: int, size: int, row: int) -> np.ndarray:
        return (
            np.ndarray((size // row, row), dtype=np.uint8, buffer=self._shm.buf, offset=offset)
            if size
            else np.zeros((0, row), np.uint8)
        )

    def k(self, layer: int) -> np.ndarray:
        off, size = self._kv[layer]
        return self._view(off, size, self.layout.region_bytes_k // self.layout.num_pages)

    def v(self, layer: int) -> np.ndarray:
        if not self.layout.num_v_regions:
            raise ValueError("MLA and hnd_kv pools have no V regions")
        off, size = self._kv[self.layout.num_layers + layer]
        return self._view(off, size, self.layout.page_bytes_v)

    def aux(self, name: str) -> np.ndarray:
        off, row_bytes, rows = self._aux[name]
        return self._view(off, row_bytes * rows, row_bytes)

    @property
    def k_regions(self) -> list[Region]:
        return [shm_region(self.name, s, o) for o, s in self._kv[: self.layout.num_layers]]

    @property
    def v_regions(self) -> list[Region]:
        return [shm_region(self.name, s, o) for o, s in self._kv[self.layout.num_layers :]]

    @property
    def aux_specs(self) -> list[AuxSpec]:
        return [
            AuxSpec(n, shm_region(self.name, rb * rows, off), rb, rows)
            for n, (off, rb, rows) in self._aux.items()
        ]

    def close(self) -> None:
        """Unmap; the creating pool also unlinks the object."""
        self._shm.close()
        if self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> ShmKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def _pool_bytes(layout: Layout, aux: dict[str, tuple[int, int]]) -> int:
    pos = 0
    for size in [layout.region_bytes_k] * layout.num_layers + [layout.region_bytes_v] * layout.num_v_regions:
        pos = _align(pos + size)
    for row_bytes, rows in aux.values():
        pos = _align(pos + row_bytes * rows)
    return max(pos, 1)


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach without Python's resource tracker adopting the object.

    NOTE: before Python 3.13 attaching registers the segment with the resource tracker, which
    unlinks it when the *attaching* process exits and so destroys the owner's pool.
    """
    try:
        return shared_memory.SharedMemory(name=name, create=False, track=False)  # type: ignore[call-arg]
    except TypeError:
        from multiprocessing import resource_tracker

        shm = shared_memory.SharedMemory(name=name, create=False)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm
