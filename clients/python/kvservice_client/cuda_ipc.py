"""CUDA IPC through the driver API (ctypes on libcuda), without cupy or torch internals.

CUDA IPC exports whole allocations. A tensor inside a larger PyTorch caching-allocator block is
therefore exported as (handle of the block, offset of the tensor in it); the importer opens the
block once and adds the offset. Note: allocations made with expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) cannot be exported this way.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from typing import Any

__all__ = [
    "CudaIpcExport",
    "close_handle",
    "copy_async",
    "device_uuid",
    "enable_peer_access",
    "export_pointer",
    "open_handle",
]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CudaError(RuntimeError):
    """A CUDA driver call failed; ``result`` is the CUresult."""

    def __init__(self, call: str, result: int) -> None:
        name = ctypes.c_char_p()
        lib = _lib
        if lib is not None:
            lib.cuGetErrorName(result, ctypes.byref(name))
        text = name.value.decode() if name.value else str(result)
        super().__init__(f"{call} failed: {text}")
        self.result = result


def _driver() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            res = lib.cuInit(0)
            if res != 0:
                raise CudaError("cuInit", res)
            _lib = lib
        return _lib


def _check(call: str, result: int) -> None:
    if result != 0:
        raise CudaError(call, result)


def device_uuid(ordinal: int) -> str:
    """'GPU-xxxxxxxx-...' of the device with this ordinal in this process."""
    lib = _driver()
    dev = ctypes.c_int()
    _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ordinal))
    uuid = _Uuid()
    _check("cuDeviceGetUuid", lib.cuDeviceGetUuid(ctypes.byref(uuid), dev))
    h = bytes(uuid.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _ordinal_of(uuid: str) -> int:
    lib = _driver()
    count = ctypes.c_int()
    _check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
    for i in range(count.value):
        if device_uuid(i) == uuid:
            return i
    raise LookupError(f"no visible CUDA device has uuid {uuid}")


@dataclasses.dataclass(frozen=True)
class CudaIpcExport:
    """What an importer needs: the block's handle, the pointer's offset in it, sizes, device."""

    handle: bytes
    offset: int
    allocation_size: int
    device_index: int
    device_uuid: str


def export_pointer(ptr: int, device_index: int) -> CudaIpcExport:
    """Export the allocation containing device pointer ``ptr`` of device ``device_index``.

    Makes that device's primary context current on the calling thread first (the context torch
    allocates in), so tensors on a non-current GPU export too.
    """
    lib = _driver()
    _make_current(lib, device_index)
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    _check(
        "cuMemGetAddressRange",
        lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
    )
    handle = _Handle()
    _check("cuIpcGetMemHandle", lib.cuIpcGetMemHandle(ctypes.byref(handle), base))
    return CudaIpcExport(
        handle=ctypes.string_at(ctypes.addressof(handle), 64),  # NOTE: .reserved stops at a NUL
        offset=ptr - base.value,
        allocation_size=size.value,
        device_index=device_index,
        device_uuid=device_uuid(device_index),
    )


def open_handle(
    handle: bytes, device_uuid_or_index: str | int, context: int | None = None
) -> tuple[int, int]:
    """Open an exported allocation in this process; returns (base pointer, device ordinal).

    Makes the primary context of ``context`` (default: the allocation's device) current on the
    calling thread (the one torch uses) and opens the handle there: the pointer is valid for
    kernels of that GPU only. Another GPU's context gives a second mapping of the same memory,
    reached over the link (peer access); a context opens one handle at most once.
    """
    if len(handle) != 64:
        raise ValueError(f"handle must be 64 bytes, got {len(handle)}")
    lib = _driver()
    ordinal = (
        _ordinal_of(device_uuid_or_index) if isinstance(device_uuid_or_index, str) else device_uuid_or_index
    )
    _make_current(lib, ordinal if context is None else context)
    h = _Handle()
    ctypes.memmove(ctypes.addressof(h), handle, 64)
    ptr = ctypes.c_uint64()
    # 1 = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    _check("cuIpcOpenMemHandle", lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, ctypes.c_uint(1)))
    return ptr.value, ordinal


def _make_current(lib: ctypes.CDLL, ordinal: int) -> None:
    dev = ctypes.c_int()
    _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ordinal))
    ctx = ctypes.c_void_p()
    _check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    _check("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))


def enable_peer_access(ordinal: int, peer_ordinal: int) -> bool:
    """Let kernels on device ``ordinal`` read and write ``peer_ordinal``'s memory (primary contexts).

    Returns False when the pair cannot access each other (no P2P link); True when enabled now
    or before.
    """
    lib = _driver()
    dev, peer = ctypes.c_int(), ctypes.c_int()
    _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ordinal))
    _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(peer), peer_ordinal))
    can = ctypes.c_int()
    _check("cuDeviceCanAccessPeer", lib.cuDeviceCanAccessPeer(ctypes.byref(can), dev, peer))
    if not can.value:
        return False
    peer_ctx = ctypes.c_void_p()
    _check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(peer_ctx), peer))
    _make_current(lib, ordinal)
    res = lib.cuCtxEnablePeerAccess(peer_ctx, ctypes.c_uint(0))
    if res not in (0, 704):  # 704 = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        raise CudaError("cuCtxEnablePeerAccess", res)
    return True


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Enqueue a copy of ``nbytes`` from device pointer ``src`` to ``dst`` on CUDA stream handle
    ``stream`` (unified addressing: the two may live on different GPUs; over the peer link when
    peer access is enabled). The calling thread's current context must be the stream's."""
    _check(
        "cuMemcpyAsync",
        _driver().cuMemcpyAsync(
            ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)
        ),
    )


def close_handle(base: int, context: int | None = None) -> None:
    """Close a mapping :func:`open_handle` returned (``context``: the GPU it was opened in)."""
    lib = _driver()
    if context is not None:
        _make_current(lib, context)
    _check("cuIpcCloseMemHandle", lib.cuIpcCloseMemHandle(ctypes.c_uint64(base)))


def tensor_export(tensor: Any) -> CudaIpcExport:
    """Export a CUDA torch tensor (any offset inside its caching-allocator block)."""
    if not tensor.is_cuda:
        raise ValueError("tensor must live on a CUDA device")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return export_pointer(tensor.data_ptr(), tensor.device.index or 0)
