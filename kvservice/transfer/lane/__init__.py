"""The native lane: a small same-node transfer in tens of microseconds, not milliseconds.

A same-node transfer over gRPC crosses two Python processes twice (SendDelta, then the DONE
event), about 0.25 ms per hop on the GPU host (docs/decisions/0014). The lane takes those
hops and the service's Python off the per-transfer path::

    engine SDK ─SEND (SOCK_SEQPACKET)─▶ native thread: armed? ─▶ copy (CUDA kernel / memcpy)
    engine SDK ◀──────────── END ────── native thread ──END──▶ receiving engine's SDK
                                        └─ completion fd ─▶ Python: records, DONE, index, metrics

``native.py`` builds the C++ (``csrc/``, a file per route: ``csrc/lane.h`` lists them),
``listener.py`` admits engines, ``book.py`` is Python's half (pools, arming, settling, the
bookkeeping after a copy). gRPC stays the API: what the lane does not take is answered
*fallback* and goes over gRPC as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ...errors import KVServiceError
from ...peers_allow import check_peer_address
from ._native_api import NativeLane
from .book import CallHandler, LaneBook, NoLane

if TYPE_CHECKING:
    from ...sessions import SessionRegistry
    from ..engine import TransferEngine
    from .listener import LaneListener

__all__ = ["LaneBook", "NoLane", "RunningLane", "start"]

log = logging.getLogger(__name__)


class RunningLane:
    def __init__(self, native: NativeLane, listener: LaneListener, book: LaneBook) -> None:
        self.native = native
        self.listener = listener
        self.book = book

    def close(self, engine: TransferEngine) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.native.completion_fd())
        self.listener.close()
        engine.detach_lane()
        self.native.stop()
        if self.book.cross is not None:
            self.book.cross.log_trace()  # what the stopped threads timed last
            self.book.cross.log_stats()


async def start(
    engine: TransferEngine,
    sessions: SessionRegistry,
    uds_path: str,
    self_addresses: list[str],
    calls: CallHandler | None = None,
) -> RunningLane | None:
    """Build/load the native module (in a thread), listen on ``<uds_path>.lane`` and attach the
    book to the transfer engine; None (logged) when the lane cannot run here. ``calls``: the
    handler of the engines' CALLs (ExpectDelta on the lane; none: they go over gRPC)."""
    from kvservice_client.lane_wire import lane_path

    from . import native
    from .listener import LaneListener

    try:
        mod = await asyncio.to_thread(native.load)
    except native.LaneUnavailable as exc:
        log.warning("native lane off: %s; same-node transfers use gRPC only", exc)
        return None
    cfg = engine.config
    lane = mod.Lane()
    from ...buffers import guard

    if (g := guard.get()) is not None:  # the lane's copies fail a pool whose memory shrank
        lane.set_guard(*g.addresses())
    lane.set_chunk(cfg.tuning.lane_cuda_chunk_kb * 1024)
    lane.set_pull(cfg.tuning.two_gpu_copy == "pull")  # the lane copies in one kernel: push or pull
    lane.set_note_after(not cfg.tuning.lane_note_with_write)
    cuda = await asyncio.to_thread(_init_cuda, lane)
    lane.set_spin_us(auto_spin_us(cfg.tuning.lane_spin_us, cuda))
    book = LaneBook(engine, lane, cuda)
    if cfg.data_plane.lane_cross_mb > 0:  # before any handshake: peers learn its agent from it
        from .cross import CrossBook

        devices = _cuda_devices() if cuda else 0
        lane.set_parts(cfg.tuning.lane_cross_parts)  # a streamed send's chunks in flight
        book.cross = await asyncio.to_thread(
            CrossBook.start,
            engine,
            lane,
            cfg.data_plane.lane_cross_mb,
            devices,
            cfg.tuning.lane_cross_stream,
            cfg.tuning.lane_cross_gpu_mb,
        )
    engine.attach_lane(book)
    sessions.on_close(book.drop_session)
    if calls is not None:
        book.serve_calls(calls)
    allowed = []  # the lane aims only at this service: listed when peer_allowlist lets SendDelta aim here
    for address in self_addresses:
        try:
            check_peer_address(address, cfg.security.peer_allowlist_entries)
            allowed.append(address)
        except KVServiceError:
            pass
    listener = LaneListener(
        lane_path(uds_path),
        cfg.listen.uds_mode_int,
        sessions,
        cfg.security.allowed_uid_set,
        lane,
        allowed,
        book.cross is not None,
        auto_spin_us(cfg.tuning.lane_wait_spin_us, cuda),
        calls=("expect_delta",) if calls is not None else (),
    )
    listener.start()
    asyncio.get_running_loop().add_reader(lane.completion_fd(), book.on_completions)
    log.info("native lane serving", extra={"path": listener.path, "cuda": cuda})
    return RunningLane(lane, listener, book)


# NOTE: on the GPU host a thread asleep in poll/epoll woke ~50-80 µs after its packet: the
# lane's thread for a SEND, an engine's waiter for its END, 4-7% of a 2 GiB copy each
# (measured on an H200: bench/run.py gpu). The lane's thread
# keeps polling 5 ms after a message (a quiet service costs nothing; a busy one a core), and so
# do its bulk thread after an offer and an engine's waiter (a 2 GiB cross-node transfer on one
# GPU takes ~4 ms).
_GPU_SPIN_US = 5000


def auto_spin_us(configured: int, cuda: bool) -> int:
    """A spin setting (``lane_spin_us``, ``lane_wait_spin_us``): as configured, or for -1 by
    whether the lane copies on a GPU (µs matter there; a host copy takes longer than a wake)."""
    if configured >= 0:
        return configured
    return _GPU_SPIN_US if cuda else 0


def _cuda_devices() -> int:
    import torch

    return int(torch.cuda.device_count())


def _init_cuda(lane: NativeLane) -> bool:
    """CUDA for the lane's copies: the AOT cubins of kernels/lane_copy.py for each capability
    present (cached: a start after the first loads them in ms). No cubins, no CUDA: GPU pools
    then use gRPC only."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
    except ImportError:
        return False
    from ...kernels import aot
    from .native import LIBCUDA

    caps = (torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    try:
        kernels = [im.as_tuple() for im in aot.images({10 * a + b for a, b in caps})]
    except Exception as exc:  # a Triton that cannot compile for this device: host pools only
        why = f"{type(exc).__name__}: {exc}"
        log.warning("native lane: copy kernel not compiled (%s); GPU pools use gRPC only", why)
        return False
    if lane.init_cuda(LIBCUDA, kernels):
        return True
    log.warning("native lane: no CUDA (%s); GPU pools use gRPC only", lane.cuda_why())
    return False
