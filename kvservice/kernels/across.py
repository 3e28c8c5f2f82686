"""A same-node copy between pools on two GPUs (``two_gpu_copy = staged``; ``auto`` from 64 MiB):
pack on the source GPU, one device-to-device copy over the link, unpack on the destination GPU,
in chunks that overlap on three streams.

    source GPU   pack stream:  pack c0 ─ pack c1 ─ pack c2 ─ …            (HBM, ~1.7 TB/s)
                 link stream:        └▶ copy c0 ─▶ copy c1 ─▶ copy c2 …    (NVLink, the bound)
    dest GPU     current stream:              └▶ unpack c0 ─ unpack c1 …  (HBM)

Why not always the fused kernel reading one GPU and writing the other: engine pools reach the
service as CUDA IPC handles, and memory another process exported is mapped only into the context
of the GPU this service opened it on. Peer access (``cuCtxEnablePeerAccess``, with or without
the lazy flag at open) does not map it into the other GPU's context: a kernel on GPU0 writing
through GPU1's opening faults with CUDA_ERROR_ILLEGAL_ADDRESS, which poisons the service's CUDA
context (2×H200: bench/probe_two_gpu_ipc.py, docs/decisions/0017). The ``push`` / ``pull``
modes open the pool a second time in the launching GPU's context
(``buffers.memory.alias_addresses``); this staged copy needs no second opening, and for 2 GiB it
is faster than one Triton kernel across the link: every kernel touches only its own GPU's pools,
the link copy moves between our own staging buffers at the copy engines' rate, and the link is
the slowest stage, so the copy of each chunk hides the next chunk's pack and the previous
chunk's unpack.

NOTE: the chunks' buffers come from torch's caching allocator, outside ``vram_staging_mb``: up to
~3 chunks on the source GPU (packed, not yet copied) and 2 on the destination, 1.25 GiB at the
default chunk, kept cached by torch once used.
"""

from __future__ import annotations

import numpy as np
import torch

from ._regions import KVRegions
from .fused import check_fused, fused_nbytes

__all__ = ["CHUNK_BYTES", "copy_across"]

CHUNK_BYTES = 256 << 20  # few chunks (each costs three launches on the loop), enough overlap


def copy_across(
    src: KVRegions,
    dst: KVRegions,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    *,
    src_head_start: int = 0,
    dst_head_start: int = 0,
    num_heads: int | None = None,
    unit: int | None = None,
    pack_stream: torch.cuda.Stream,
    link_stream: torch.cuda.Stream,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Copy like :func:`~kvservice.kernels.fused.copy_pages` between CUDA pools on two devices;
    returns the bytes moved. Asynchronous: the last unpack is on the destination device's
    current stream (record an event there to wait). ``pack_stream`` and ``link_stream`` are
    streams of the source device."""
    from kvservice_client import cuda_ipc

    from . import pack, unpack

    a = check_fused(src, dst, src_pages, dst_pages, src_head_start, dst_head_start, num_heads, unit)
    n = int(a.src_pages.size)
    if n == 0:
        return 0
    sdev, ddev = src.device, dst.device
    out_stream = torch.cuda.current_stream(ddev)
    per_unit = fused_nbytes(src, 1, a.num_heads, a.unit)
    step = max(1, chunk_bytes // per_unit)
    order = dst.head_major  # the destination's own order: its unpack is the straight copy
    with torch.cuda.device(ddev):
        # two landing buffers on the destination (out_stream's pool), taken in turn: the copy of
        # chunk k waits only for the unpack of chunk k-2, never for the one just queued
        first = torch.empty(min(step, n) * per_unit, dtype=torch.uint8, device=ddev)
        ring = [first, torch.empty_like(first) if n > step else first]
        before = torch.cuda.Event()
        before.record(out_stream)  # a block of ours may be one earlier work on out_stream still reads
    unpacked = [before, before]
    for k, i in enumerate(range(0, n, step)):
        sp, dp = a.src_pages[i : i + step], a.dst_pages[i : i + step]
        with torch.cuda.device(sdev):
            with torch.cuda.stream(pack_stream):
                staged = pack(
                    src, sp, head_start=a.src_head_start, num_heads=a.num_heads, unit=a.unit, head_major=order
                )
            packed = torch.cuda.Event()
            packed.record(pack_stream)
            landed = ring[k % 2][: staged.numel()]
            link_stream.wait_event(packed)
            link_stream.wait_event(unpacked[k % 2])
            cuda_ipc.copy_async(landed.data_ptr(), staged.data_ptr(), staged.numel(), link_stream.cuda_stream)
            staged.record_stream(link_stream)  # the pack stream reuses it only after the copy read it
            copied = torch.cuda.Event()
            copied.record(link_stream)
        with torch.cuda.device(ddev):
            out_stream.wait_event(copied)
            unpack(
                dst,
                landed,
                dp,
                head_start=a.dst_head_start,
                num_heads=a.num_heads,
                unit=a.unit,
                head_major=order,
            )
            unpacked[k % 2] = torch.cuda.Event()
            unpacked[k % 2].record(out_stream)
    return n * per_unit
