"""Run a copy on a side CUDA stream of the calling thread and wait for it.

Worker threads would otherwise launch on the legacy default stream, which serialises with every
other stream of the device (UCX's copies, other batches' kernels): no pack/wire/unpack overlap.
One non-blocking stream per (thread, device), reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["on_side_stream", "service_stream"]

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


_service_streams: dict[int, Any] = {}


def service_stream(index: int) -> Any:
    """The service-owned launch stream of CUDA device ``index`` (made on first use, kept)."""
    stream = _service_streams.get(index)
    if stream is None:
        stream = _service_streams[index] = torch.cuda.Stream(device=index)
    return stream
