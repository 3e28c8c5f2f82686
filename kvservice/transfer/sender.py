"""Sender side: SendDelta chunks queued per transfer, moved in order, committed to the receiver.

Each outgoing transfer (one per source buffer set) owns a worker task that takes its chunks in
arrival order; a per-destination semaphore bounds how many chunks move to one peer at once
(the "worker pool" of seed 003). A chunk: map positions onto the receiver's plan (skipping
prefix pages), then per receiver rank hand it to the route dispatch.py picks (a fused copy,
packed batches, or direct page writes; routes/), which commits it to the receiver. A failure
fails the transfer and drops the remaining chunks; an abort or the deadline stops it after every
in-flight handle settled (``writes.wait_write``), so no byte lands after the receiver is told.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..buffers import BufferSet
from ..errors import Aborted, DeadlineExceeded, KVServiceError
from .budget import ByteBudget
from .plan import ChunkMap, map_chunk
from .records import Record, TransferTable
from .values import Target

__all__ = ["Chunk", "Outgoing", "Sender", "Target", "check_live"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Chunk:
    seq: int
    offset: int
    src: np.ndarray
    last: bool
    aux: dict[str, np.ndarray]
    queued: float
    copied: tuple[int, int] | None = None  # (bytes, µs): the native lane already copied it
    copied_aux: int = 0  # ... and this many aux rows (their bytes are in ``copied``)


@dataclasses.dataclass(eq=False)
class Outgoing:
    rec: Record
    bs: BufferSet
    peer_address: str
    path: str
    chunks: collections.deque[Chunk] = dataclasses.field(default_factory=collections.deque)
    next_offset: int = 0
    seq: int = 0
    got_last: bool = False
    targets: list[Target] | None = None
    tickets: set[str] = dataclasses.field(default_factory=set)  # its plans' tickets, as they arrive
    stop: str = ""  # error code that stops the worker ("ABORTED", "DEADLINE_EXCEEDED", ...)
    stop_reason: str = ""
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    idle: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    planning: asyncio.Task[Any] | None = None  # the receive-plan wait, cancelled by stop()
    sent_src: list[np.ndarray] = dataclasses.field(default_factory=list)  # every chunk's source pages
    no_duplicate_mark: bool = False  # SendDelta's hint (first chunk): never a P/D duplicate mark
    via_lane: bool = False  # booked after the native lane moved it (kvservice.transfer.lane)
    # a stream of the native lane, booked chunk by chunk: ends it there (with the reason)
    lane_abort: Callable[[str], None] | None = None


def check_live(out: Outgoing) -> None:
    """Raise (Aborted / DeadlineExceeded) once ``out`` was stopped or its deadline passed. Never
    for the lane's booking (``via_lane``): the native thread took the copy before the deadline,
    made it and told both engines DONE; what is left only books that (see ``Sender.stop``)."""
    if out.via_lane:
        return
    if out.stop:
        raise (DeadlineExceeded if out.stop == "DEADLINE_EXCEEDED" else Aborted)(out.stop_reason)
    if time.monotonic() > out.rec.deadline:
        out.stop, out.stop_reason = "DEADLINE_EXCEEDED", "transfer deadline passed"
        raise DeadlineExceeded(out.stop_reason)


class Movement(Protocol):
    """What moves a sender's chunks (dispatch.Dispatch)."""

    def targets_now(self, out: Outgoing) -> list[Target] | None: ...

    async def fetch_targets(self, out: Outgoing) -> list[Target]: ...

    async def move(self, out: Outgoing, target: Target, chunk: Chunk, cmap: ChunkMap) -> None: ...

    async def tell_abort(self, out: Outgoing, code: str, reason: str) -> None: ...


class Sender:
    """Outgoing transfers of this service; runs on the event loop. ``dispatch`` moves the bytes."""

    def __init__(
        self,
        table: TransferTable,
        dispatch: Movement,
        workers_per_peer: int = 64,
        peer_inflight_mb: int = 1024,
    ) -> None:
        self.table = table
        self.dispatch = dispatch
        self.outgoing: dict[tuple[str, str], Outgoing] = {}  # (transfer id, buffer set id) -> it
        self._by_tid: dict[str, dict[str, Outgoing]] = {}  # transfer id -> buffer set id -> it
        self._budgets: dict[str, ByteBudget] = {}
        self._workers = workers_per_peer
        self._inflight = peer_inflight_mb << 20
        self.queue_depth: collections.Counter[str] = collections.Counter()

    def add(self, out: Outgoing) -> None:
        key = (out.rec.transfer_id, out.bs.buffer_set_id)
        self.outgoing[key] = out
        self._by_tid.setdefault(key[0], {})[key[1]] = out

    def of(self, transfer_id: str) -> list[Outgoing]:
        """The outgoing sides of ``transfer_id`` (every source buffer set), in O(their number)."""
        return list(self._by_tid.get(transfer_id, {}).values())

    def forget(self, key: tuple[str, str]) -> None:
        """Drop a finished outgoing side (the table pruned its record)."""
        out = self.outgoing.pop(key, None)
        per = self._by_tid.get(key[0])
        if out is not None and per is not None and per.get(key[1]) is out:
            del per[key[1]]
            if not per:
                del self._by_tid[key[0]]

    def enqueue(self, out: Outgoing, chunk: Chunk) -> None:
        out.chunks.append(chunk)
        out.sent_src.append(chunk.src)
        self.queue_depth[out.peer_address] += 1
        if out.task is None:
            out.task = asyncio.get_running_loop().create_task(
                self._run(out), name=f"send-{out.rec.transfer_id}"
            )
        out.wake.set()

    async def _run(self, out: Outgoing) -> None:
        rec = out.rec
        budget = self._budgets.get(out.peer_address)
        if budget is None:
            budget = self._budgets[out.peer_address] = ByteBudget(self._inflight, self._workers)
        try:
            while True:
                check_live(out)
                if not out.chunks:
                    out.idle.set()
                    out.wake.clear()
                    await out.wake.wait()
                    continue
                chunk = out.chunks[0]
                out.idle.clear()
                queued = int((time.monotonic() - chunk.queued) * 1e6)
                if chunk.copied is not None:  # the lane's copy is made: no byte in flight to budget
                    self.table.update(rec, state="TRANSFERRING", add_queue=queued)
                    await self._chunk(out, chunk)
                else:
                    async with budget.hold(chunk.src.size * out.bs.layout.page_bytes_all_layers):
                        self.table.update(rec, state="TRANSFERRING", add_queue=queued)
                        await self._chunk(out, chunk)
                out.chunks.popleft()
                self.queue_depth[out.peer_address] -= 1
                self.table.update(rec, add_chunks_done=1)
                if chunk.last:
                    self.table.finish(rec, "DONE")
                    return
        except KVServiceError as exc:
            code = out.stop or exc.code.name
            state = "ABORTED" if code == "ABORTED" else "FAILED"
            reason = out.stop_reason or exc.message
            if self.table.finish(rec, state, code, reason):
                await self.dispatch.tell_abort(out, code, reason)
        except Exception as exc:
            log.exception("sender failed", extra={"transfer_id": rec.transfer_id})
            if self.table.finish(rec, "FAILED", "INTERNAL", f"{type(exc).__name__}: {exc}"):
                await self.dispatch.tell_abort(out, "INTERNAL", str(exc))
        finally:
            self.queue_depth[out.peer_address] -= len(out.chunks)
            out.chunks.clear()
            out.idle.set()

    async def _chunk(self, out: Outgoing, chunk: Chunk) -> None:
        mover = self.dispatch
        if out.targets is None:  # an offered plan (data path v3 §3): no wait, no task
            t0 = time.monotonic()
            out.targets = mover.targets_now(out)
            if out.targets is not None:
                self.table.update(out.rec, add_plan=int((time.monotonic() - t0) * 1e6))
        if out.targets is None:
            t0 = time.monotonic()
            # NOTE: the plan wait (up to the deadline, when the receiver has not declared yet)
            # holds no handle and no byte: stop() cancels it, so an Abort settles at once.
            out.planning = asyncio.ensure_future(mover.fetch_targets(out))
            try:
                out.targets = await out.planning
                out.tickets.update(t.plan.sender_ticket for t in out.targets)
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if out.stop and not (me is not None and getattr(me, "cancelling", lambda: 0)()):
                    raise (DeadlineExceeded if out.stop == "DEADLINE_EXCEEDED" else Aborted)(
                        out.stop_reason
                    ) from None
                raise
            finally:
                out.planning = None
            self.table.update(out.rec, add_plan=int((time.monotonic() - t0) * 1e6))
        if not out.targets:  # a replica that another rank covers (MLA, replicated heads)
            self.table.update(out.rec, add_pages_skipped=int(chunk.src.size))
            return
        for i, target in enumerate(out.targets):
            check_live(out)
            t0 = time.monotonic()
            cmap: ChunkMap = map_chunk(
                chunk.offset, chunk.src, target.plan.prefix_pages, target.dst_pages, target.units, chunk.last
            )
            self.table.update(out.rec, add_plan=int((time.monotonic() - t0) * 1e6))
            await mover.move(out, target, chunk, cmap)
            if i == 0:  # pages count once per chunk, whatever the number of receiver ranks
                self.table.update(out.rec, add_pages_sent=cmap.num_pages, add_pages_skipped=cmap.skipped)

    def stop(self, out: Outgoing, code: str, reason: str) -> None:
        """Stop ``out``'s worker (``stopped`` waits for it). The lane's booking is not stopped:
        its copy is made, both engines heard DONE, and its worker waits on nothing but this
        service's own bookkeeping; an end that meets it waits for it (``stopped``), as a
        receiver's settle does (kvservice.transfer.lane.book). Stopped, it would tell the receiver, whose
        settle waits for the booking, which waits for this worker: none of them would end."""
        if out.via_lane:
            if out.lane_abort is not None and not out.stop:  # a lane stream: it ends there first
                out.stop, out.stop_reason = code, reason
                out.lane_abort(reason)
            return
        if not out.stop:
            out.stop, out.stop_reason = code, reason
        if out.planning is not None and not out.planning.done():
            out.planning.cancel()
        out.wake.set()

    async def stopped(self, out: Outgoing) -> None:
        """Wait until the worker holds no in-flight handle (settled) after ``stop``."""
        task = out.task
        if task is not None and not task.done():
            # (asyncio.wait's set and callbacks cost ~10 µs a booking; a cancelled waiter leaves
            # the worker running, as asyncio.wait does)
            done = asyncio.get_running_loop().create_future()
            task.add_done_callback(lambda _t: done.done() or done.set_result(None))
            await done
