"""CUDA streams of the service: per-thread side streams, and service streams awaited without
blocking the loop (``run_on_device``).

Worker threads would otherwise launch on the legacy default stream, which serialises with every
other stream of the device (UCX's copies, other batches' kernels): no pack/wire/unpack overlap.
One non-blocking stream per (thread, device), reused.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["on_side_stream", "run_on_device", "service_stream"]

_local = threading.local()


def on_side_stream(device: torch.device, fn: Callable[[], Any]) -> Any:
    """Call ``fn`` with a per-thread side stream current on ``device`` (CUDA), then synchronise it.

    On CPU devices ``fn`` just runs.
    """
    if device.type != "cuda":
        return fn()
    streams: dict[int, torch.cuda.Stream] = getattr(_local, "streams", None) or {}
    _local.streams = streams
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(device=index)
    with torch.cuda.device(index), torch.cuda.stream(stream):
        result = fn()
    stream.synchronize()
    return result


_service_streams: dict[tuple[int, str], Any] = {}


def service_stream(index: int, role: str = "copy") -> Any:
    """The service-owned launch stream ``role`` of CUDA device ``index`` (made on first use,
    kept): "copy" for fused copies, "pack" and "unpack" for the packed route's two ends, so a
    batch's pack overlaps another's unpack."""
    stream = _service_streams.get((index, role))
    if stream is None:
        stream = _service_streams[(index, role)] = torch.cuda.Stream(device=index)
    return stream


async def run_on_device(device: torch.device, role: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (kernel launches) and return its result once its work is done, never blocking
    the loop: on CUDA it launches from the calling (loop) thread on the service stream ``role``
    and a completion thread waits for the event (``completions``); on the CPU it runs in a worker
    thread (the copies release the GIL)."""
    if device.type != "cuda":
        return await asyncio.to_thread(fn)
    from . import completions

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = service_stream(index, role)
    with torch.cuda.device(index), torch.cuda.stream(stream):
        result = fn()
        event = torch.cuda.Event()
        event.record(stream)
    await completions.done(event, (index, role))
    return result
