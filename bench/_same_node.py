"""Same-node ceilings for bench_transfer --same-node: one contiguous copy of the same bytes, and
the fused kernel alone (in this process, no service), both timed in the run that times kvservice.

    CPU:  ctypes.memmove of the bytes between two POSIX shm segments (one memcpy, the same kind of
          memory as the pools: 4 KiB pages, no transparent huge pages), and between two anonymous
          buffers (huge pages where the kernel gives them)
    GPU:  a device-to-device copy (same GPU) or a peer copy (GPU a -> GPU b) of the bytes
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
from kvservice_client import Layout


def _sync(*devs: Any) -> None:
    import torch

    for d in devs:
        if d != "cpu":
            torch.cuda.synchronize(int(d))


def _memmove_times(a: np.ndarray, b: np.ndarray, iters: int) -> list[float]:
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        ctypes.memmove(b.ctypes.data, a.ctypes.data, a.nbytes)
        times.append(time.perf_counter() - t0)
    return times[1:]


def contiguous_copy_anon(nbytes: int, iters: int) -> list[float]:
    return _memmove_times(np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8), iters)


def contiguous_copy(sdev: Any, ddev: Any, nbytes: int, iters: int) -> list[float]:
    """Seconds per copy of ``nbytes`` contiguous bytes from the source to the destination device."""
    times = []
    if sdev == "cpu":
        from multiprocessing import shared_memory

        segs = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(2)]
        try:
            a, b = (np.ndarray(nbytes, np.uint8, s.buf) for s in segs)
            a[:], b[:] = 1, 2  # touch every page first
            times = _memmove_times(a, b, iters)
            del a, b
        finally:
            for s in segs:
                s.close()
                s.unlink()
        return times
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{sdev}")
    b = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{ddev}")
    for _ in range(iters + 1):
        _sync(sdev, ddev)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(sdev, ddev)
        times.append(time.perf_counter() - t0)
    return times[1:]


def _regions(layout: Layout, pool: Any) -> Any:
    import torch

    from kvservice.kernels import KVRegions

    L = layout.num_layers
    conv = (lambda x: torch.from_numpy(x)) if pool.device == "cpu" else (lambda x: x)
    return KVRegions.create(
        [conv(pool.k(i)) for i in range(L)],
        [conv(pool.v(i)) for i in range(L)],
        page_size=layout.page_size,
        num_heads=layout.local_kv_heads,
        head_dim_k=layout.head_dim_k,
        itemsize=layout.itemsize,
    )


def fused_kernel_only(
    layout: Layout, src_pool: Any, dst_pool: Any, src: np.ndarray, dst: np.ndarray, iters: int
) -> list[float]:
    """Seconds per ``copy_pages`` call over the same pools and pages (no service, no RPC)."""
    from kvservice.kernels.fused import copy_pages

    rs, rd = _regions(layout, src_pool), _regions(layout, dst_pool)
    if src_pool.device != "cpu" and src_pool.device != dst_pool.device:
        from kvservice_client import cuda_ipc

        cuda_ipc.enable_peer_access(int(src_pool.device), int(dst_pool.device))
    times = []
    for _ in range(iters + 1):
        _sync(src_pool.device, dst_pool.device)
        t0 = time.perf_counter()
        if src_pool.device == "cpu":
            copy_pages(rs, rd, src, dst)
        else:
            import torch

            with torch.cuda.device(int(src_pool.device)):
                copy_pages(rs, rd, src, dst)
        _sync(src_pool.device, dst_pool.device)
        times.append(time.perf_counter() - t0)
    return times[1:]
