"""Importing engine memory into the service: POSIX shared memory and CUDA IPC.

A :class:`MappedRegion` is a window ``[address, address + size)`` into memory another process
owns, plus a uint8 torch view of it. Mappings are reference-counted per source object (one
mmap per shm name, one ``cuIpcOpenMemHandle`` per exported allocation) because an engine usually
exports many regions out of one object, and CUDA refuses to open the same handle twice.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgument, KVServiceError, PermissionDenied, Unimplemented, translate_os_error
from . import guard

__all__ = ["MappedRegion", "MemoryImporter", "alias_addresses"]

_SHM_NAME = re.compile(r"^/?[A-Za-z0-9_.\-]{1,240}$")


@dataclasses.dataclass(frozen=True)
class MappedRegion:
    """An imported region. ``tensor`` is a flat uint8 view of exactly ``size`` bytes."""

    address: int
    size: int
    mem_kind: str  # "DRAM" or "VRAM"
    device: int
    tensor: torch.Tensor
    source: str  # key of the mapping it lives in
    origin: Any = None  # the common_pb2.Region it was imported from (handed to same-host peers)
    guard_slot: int = -1  # its mapping's slot in the fault guard (shm), or -1 (guard.py)

    def pages(self, page_bytes: int) -> torch.Tensor:
        """The region as ``[num_pages, page_bytes]`` uint8."""
        return self.tensor.view(-1, page_bytes)


class _CudaArray:
    """Minimal __cuda_array_interface__ owner so torch can view imported VRAM without copying."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


_importers: weakref.WeakSet[MemoryImporter] = weakref.WeakSet()


def alias_addresses(addresses: Sequence[int], device: int) -> list[int] | None:
    """The same memory as device pointers a kernel on GPU ``device`` may use (docs/decisions/0017).

    An imported CUDA IPC allocation is mapped only in the context it was opened in; peer access
    does not extend that mapping to another GPU. So a kernel on ``device`` reaches an imported
    pool of another GPU only through a second opening of its handle in ``device``'s context
    (made on first use, closed with the first mapping). An address of memory no importer holds
    (this process's own allocations: peer access reaches them) stays as it is. None if a second
    opening fails (no peer path): the caller copies another way.
    """
    out = [int(a) for a in addresses]
    for imp in list(_importers):
        if not imp.translate(out, device):
            return None
    return out


def _guard_mapping(arr: np.ndarray, length: int) -> int:
    """Guard a new shm mapping against its owner shrinking it (guard.py): its slot, or -1.

    NOTE: the slot is released when ``arr`` is collected, i.e. when the last view of the mapping
    is gone and the mmap is about to be unmapped, not when the buffer set is unregistered: a copy
    still holding a view stays guarded."""
    g = guard.get()
    if g is None:
        return -1
    slot = g.add(arr.ctypes.data, length)
    if slot >= 0:
        weakref.finalize(arr, g.remove, slot)
    return slot


class MemoryImporter:
    """Opens and closes engine memory; thread-safe; one instance per service."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # key -> [refcount, backing, base_ptr, length]; CUDA: [refcount, ordinal, base_ptr,
        # length, handle, {other device: base_ptr of its own opening}]
        self._maps: dict[str, list[Any]] = {}
        _importers.add(self)

    def translate(self, addresses: list[int], device: int) -> bool:
        """Rewrite (in place) each address inside an imported CUDA allocation of another GPU into
        its mapping in ``device``'s context, opening it there on first use; False if that fails."""
        from kvservice_client import cuda_ipc

        with self._lock:
            cuda = [e for k, e in self._maps.items() if k.startswith("cuda:") and e[1] != device]
            if not cuda:
                return True
            for i, a in enumerate(addresses):
                e = next((e for e in cuda if e[2] <= a < e[2] + e[3]), None)
                if e is None:
                    continue
                alias = e[5].get(device)
                if alias is None:
                    try:
                        alias, _ = cuda_ipc.open_handle(e[4], e[1], context=device)
                    except (cuda_ipc.CudaError, OSError):
                        return False
                    e[5][device] = alias
                addresses[i] = alias + (a - e[2])
        return True

    def import_region(self, field: str, region: Any, owner_uid: int | None = None) -> MappedRegion:
        """Map one ``common_pb2.Region``; raises InvalidArgument naming ``field``.

        With ``owner_uid``, a shm segment owned by anyone else is PermissionDenied (the owner is
        read from the file system, never taken from the request).
        """
        which = region.WhichOneof("memory")
        if which == "shm":
            m = self._import_shm(field, region.shm.name, region.shm.offset, region.size_bytes, owner_uid)
        elif which == "cuda_ipc":
            m = self._import_cuda(field, region.cuda_ipc, region.size_bytes)
        else:
            raise InvalidArgument(f"{field}.memory", "one of shm or cuda_ipc is required")
        return dataclasses.replace(m, origin=region)

    def _import_shm(
        self, field: str, name: str, offset: int, size: int, owner_uid: int | None
    ) -> MappedRegion:
        if not _SHM_NAME.match(name):
            raise InvalidArgument(f"{field}.shm.name", f"{name!r} is not a POSIX shared-memory name")
        if offset % 64:
            raise InvalidArgument(f"{field}.shm.offset", "must be a multiple of 64 bytes")
        key = "shm:" + name.lstrip("/")
        with self._lock:
            entry = self._maps.get(key)
            if entry is None:
                path = "/dev/shm/" + name.lstrip("/")
                try:
                    fd = os.open(path, os.O_RDWR)
                except OSError as exc:
                    raise translate_os_error(f"{field}.shm.name", exc) from None
                try:
                    st = os.fstat(fd)  # NOTE: the owner of the file we opened (no stat/open race)
                    length = st.st_size
                    if length == 0:
                        raise InvalidArgument(f"{field}.shm.name", f"{name!r} is empty")
                    mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                except OSError as exc:
                    raise translate_os_error(f"{field}.shm.name", exc) from None
                finally:
                    os.close(fd)
                arr = np.frombuffer(mm, dtype=np.uint8)
                slot = _guard_mapping(arr, length)
                entry = [0, (mm, arr), arr.ctypes.data, length, st.st_uid, slot]
                self._maps[key] = entry
            _, (_, arr), base, length, owner, slot = entry
            if owner_uid is not None and owner != owner_uid:
                if entry[0] == 0:
                    self._close_locked(key)
                raise PermissionDenied(
                    f"{field}.shm.name: {name!r} belongs to uid {owner}, not to the caller "
                    f"(uid {owner_uid}); only a segment's owner may register it"
                )
            if offset + size > length:
                if entry[0] == 0:
                    self._close_locked(key)
                raise InvalidArgument(
                    f"{field}.size_bytes", f"offset {offset} + size {size} exceeds {name!r} ({length} bytes)"
                )
            entry[0] += 1
        view = torch.from_numpy(arr[offset : offset + size])
        return MappedRegion(base + offset, size, "DRAM", 0, view, key, guard_slot=slot)

    def _import_cuda(self, field: str, ipc: Any, size: int) -> MappedRegion:
        if not torch.cuda.is_available():
            raise Unimplemented(f"{field}.cuda_ipc: this service runs without CUDA; register shm regions")
        from kvservice_client import cuda_ipc

        if len(ipc.handle) != 64:
            raise InvalidArgument(f"{field}.cuda_ipc.handle", f"must be 64 bytes, got {len(ipc.handle)}")
        if ipc.offset + size > ipc.allocation_size:
            raise InvalidArgument(
                f"{field}.size_bytes",
                f"offset {ipc.offset} + size {size} exceeds the allocation ({ipc.allocation_size} bytes)",
            )
        key = "cuda:" + ipc.handle.hex()
        with self._lock:
            entry = self._maps.get(key)
            if entry is None:
                try:
                    base, ordinal = cuda_ipc.open_handle(ipc.handle, ipc.device_uuid or ipc.device_index)
                except (cuda_ipc.CudaError, LookupError, ValueError, OSError) as exc:
                    raise InvalidArgument(f"{field}.cuda_ipc", f"cannot open handle: {exc}") from None
                entry = [0, ordinal, base, ipc.allocation_size, bytes(ipc.handle), {}]
                self._maps[key] = entry
            entry[0] += 1
            ordinal, base = entry[1], entry[2]
        view = torch.as_tensor(_CudaArray(base + ipc.offset, size), device=f"cuda:{ordinal}")
        return MappedRegion(base + ipc.offset, size, "VRAM", ordinal, view, key)

    def release(self, region: MappedRegion) -> None:
        """Drop one reference; the mapping closes with its last region."""
        with self._lock:
            entry = self._maps.get(region.source)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] <= 0:
                self._close_locked(region.source)

    def _close_locked(self, key: str) -> None:
        entry = self._maps.pop(key)
        if key.startswith("shm:"):
            # NOTE: the mmap is unmapped when its last view (numpy array / torch tensor) is
            # collected; closing it explicitly would fail while a region object is alive.
            return
        else:
            from kvservice_client import cuda_ipc

            try:
                for device, alias in entry[5].items():  # the other GPUs' openings first
                    cuda_ipc.close_handle(alias, context=device)
                cuda_ipc.close_handle(entry[2], context=entry[1])
            except cuda_ipc.CudaError as exc:
                raise KVServiceError(f"closing CUDA IPC mapping: {exc}") from None

    @property
    def open_mappings(self) -> int:
        with self._lock:
            return len(self._maps)
