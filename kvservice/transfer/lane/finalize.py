"""The lane's completions booked: each copy the native thread made (or failed to make) becomes
the ordinary same-node send of a copy already made (records, commit, DONE, index, metrics), and
each cross-node end goes to the cross-node book (cross.py). Waiters (settle, gate, a failed
sibling's booking) wait here until every pending copy into a receiver rank is booked.

    completion fd ─▶ on_completions ─▶ a task per completion: _finalize (same node) or _cross_done
                                       └─▶ forget: the native entry's pending count ─▶ wake waiters
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ...errors import Aborted, KVServiceError
from .cross_in import CANCELLED

if TYPE_CHECKING:
    from ...buffers.registry import BufferSet
    from ..receiver import Incoming
    from ..sender import Outgoing
    from ._native_api import Completion
    from .book import LaneBook

__all__ = ["Finalizer", "booking"]

log = logging.getLogger(__name__)
# The (transfer id, rank) a finalize books, seen by it and by every task it starts (the booking's
# sender worker, the receiver's end that worker may tell): their settle of it must not wait for
# the finalize, which waits for them.
_BOOKING: contextvars.ContextVar[tuple[str, tuple[int, ...]] | None] = contextvars.ContextVar(
    "lane_booking", default=None
)


def booking(transfer_id: str, rank: int) -> bool:
    """This task books (or was started by the booking of) receiver rank ``rank`` of ``transfer_id``."""
    b = _BOOKING.get()
    return b is not None and b[0] == transfer_id and rank in b[1]


class Finalizer:
    """The completions of one lane (``book``: its LaneBook, for pools and the cross-node book)."""

    def __init__(self, book: LaneBook) -> None:
        self.book = book
        self.e = book.e
        self.n = book.n
        self._waiters: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._chains: dict[tuple[str, str], asyncio.Future[None]] = {}  # (tid, sender bs): its last booking
        self._outs: dict[tuple[str, str], Outgoing] = {}
        self._receiver_ends: dict[
            str, tuple[str, str]
        ] = {}  # tid -> how its receiver ended it  # a stream's sending side, booked chunk by chunk
        self.sent = 0  # transfers the lane moved (finalized)
        self.failed = 0

    def on_completions(self) -> None:
        """The native thread's completion fd is readable: book each completion in a task (a
        same-node stream's in order: each waits for the one before it)."""
        loop = asyncio.get_running_loop()
        for c in self.n.drain():
            kind = c[-1]
            if kind in (0, 3):  # a same-node stream's end, or a chunk of it before the last
                key = (c[0], c[2])
                prev, mine = self._chains.get(key), loop.create_future()
                self._chains[key] = mine
                work = self._in_turn(key, prev, mine, self._stream(kind == 0, *c[:-1]))
            else:
                work = self._cross_done(kind, c)
            task = loop.create_task(work, name=f"lane-{c[0]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _in_turn(
        self,
        key: tuple[str, str],
        prev: asyncio.Future[None] | None,
        mine: asyncio.Future[None],
        work: Awaitable[None],
    ) -> None:
        try:
            if prev is not None:
                await asyncio.shield(prev)
            await work
        finally:
            mine.set_result(None)
            if self._chains.get(key) is mine:
                del self._chains[key]

    async def _cross_done(self, kind: int, c: Completion) -> None:
        """A cross-node completion (cross.py): 1 = sent (this side's engine had its END), 4 = a
        chunk of a stream sent before its last, 2 = received into a declaration here."""
        cross = self.book.cross
        assert cross is not None  # (these kinds come only from a lane whose cross-node book runs)
        tid, rank = c[0], c[1]
        try:
            if kind == 1:
                await cross.tx.sent(c)
            elif kind == 4:
                cross.tx.chunk(c)
            else:
                _BOOKING.set((tid, (rank,)))  # this task's own context (create_task copied it)
                await cross.rx.received(tid, rank, c[5], c[6], c[7], c[8], c[10], int(c[14]))
        except Exception:
            log.exception("cross-node lane finalize failed", extra={"transfer_id": tid})
        finally:
            if kind == 2:
                self.wake((tid, rank))
            cross.log_trace()

    async def _stream(
        self,
        final: bool,
        tid: str,
        rank: int,
        bs_id: str,
        session_id: str,
        src: npt.NDArray[np.int32],
        ok: bool,
        error: str,
        nbytes: int,
        copy_us: int,
        flags: int,
        told_recv: bool,
        told_send: bool,
        ranks: list[int],
        told: list[int],
        first: int,
        aux_rows: int,
    ) -> None:
        """Book a chunk of a sender's stream the lane copied into receiver ranks ``ranks`` (its
        pages ``src`` from transfer page ``first``, ``aux_rows`` aux rows), as the ordinary
        same-node send of a copy already made (records, commit, DONE, index, metrics); with
        ``final`` its last chunk, or its failure (``told``: which ranks heard their END with it:
        their last sender)."""
        from ..records import Record
        from ..sender import Chunk, Outgoing

        e = self.e
        key = (tid, bs_id)
        ranks = list(ranks)  # (``rank``, ``told_recv``: its first, the cross-node completions' fields)
        told_by = dict(zip(ranks, told, strict=True))
        # NOTE: in this task's own context (create_task copied it), inherited by the tasks it
        # starts: the booking's sender worker, and whatever that worker ends (see settle).
        _BOOKING.set((tid, tuple(ranks)))
        incs = [i for i in e.receiver.of(tid) if i.bs.layout.tp_rank in told_by]
        bs = self.book.pool(bs_id)
        out = self._outs.pop(key, None) if final else self._outs.get(key)
        try:
            if out is None and ok and bs is not None:
                deadline = incs[0].rec.deadline if incs else time.monotonic() + 60
                rec = Record(tid, "SENDER", bs_id, session_id, deadline)
                out = Outgoing(rec, bs, e.address, "auto", no_duplicate_mark=bool(flags & 1), via_lane=True)
                out.next_offset = int(first)
                if not final:  # a stream: an end of the sending side in Python ends it natively
                    out.lane_abort = lambda why: self.n.abort_stream(tid, bs_id, why)
                    self._outs[key] = out
            if final:
                # an engine the lane told has its END: its Transfers stream need not say it again
                if out is not None:
                    out.rec.lane_told = told_send
                for inc in incs:
                    inc.rec.lane_told = inc.rec.lane_told or bool(told_by.get(inc.bs.layout.tp_rank))
            if ok and out is not None and len(incs) == len(ranks):
                # the booking: nothing stops it and nothing in it waits (an end that meets it
                # waits for it: Sender.stop)
                each = (nbytes // len(ranks), copy_us)  # per receiver rank (even head splits)
                chunk = Chunk(
                    out.seq,
                    int(first),
                    src.astype(np.int64),
                    final,
                    {},
                    time.monotonic(),
                    copied=each,
                    copied_aux=aux_rows // len(ranks),
                )
                out.seq, out.next_offset, out.got_last = out.seq + 1, int(first + src.size), final
                await e.send(out, chunk)
                if final:
                    await e.sender.stopped(out)
                    if out.rec.state == "DONE":
                        self.sent += 1
                    else:
                        self.failed += 1
                return
            if not final:
                return  # (its stream's end books what became of it)
            self.failed += 1
            await self._failed(tid, ranks, incs, bs, out, error, session_id, bs_id)
        except Exception:
            log.exception("lane finalize failed", extra={"transfer_id": tid})
        finally:
            if final:
                for r in ranks:
                    self.forget(tid, r)

    async def _failed(
        self,
        tid: str,
        ranks: list[int],
        incs: list[Incoming],
        bs: BufferSet | None,
        out: Outgoing | None,
        error: str,
        session_id: str,
        bs_id: str,
    ) -> None:
        """A stream that failed (``out``: its sending side, when chunks of it were booked)."""
        from ..records import Record

        e = self.e
        if error == CANCELLED:  # the receiver ended it mid-stream: its own end is being booked
            code, why = self._receiver_ends.pop(
                tid, ("ABORTED", "the receiver ended the transfer before its last chunk")
            )
            code = "ABORTED" if code == "ABORTED" else code
        else:
            why = error or (
                "the sender's buffer set is gone" if bs is None else "the receiver's declaration is gone"
            )
            why, code = f"lane copy failed: {why}", "INTERNAL"
        if out is not None:
            # the sending side's worker (its chunks booked) ends as a Python route's would; what
            # the engine's side said (an Abort, its buffer set unregistered) comes first
            code, why = out.stop or code, out.stop_reason or why
            out.via_lane, out.stop = False, ""
            e.sender.stop(out, code, why)
            await e.sender.stopped(out)
            e.table.finish(out.rec, "ABORTED" if code == "ABORTED" else "FAILED", code, why)
        else:
            deadline = incs[0].rec.deadline if incs else time.monotonic() + 60
            rec = Record(tid, "SENDER", bs_id, session_id, deadline)
            e.table.add(rec)
            e.table.finish(rec, "ABORTED" if code == "ABORTED" else "FAILED", code, why)
        if error == CANCELLED:
            return
        for inc in incs:
            # another sender's copy into this rank may still run: its booking first, so the
            # rank ends FAILED only once nothing writes its pages (the lane's END waits too)
            await self._booked(tid, inc.bs.layout.tp_rank, ranks)
            await e.fail_incoming(inc, Aborted(why) if code == "ABORTED" else KVServiceError(why))

    def ended_by_receiver(self, tid: str, code: str, reason: str) -> None:
        """The receiver of ``tid`` ends it (``code``, ``reason``): a stream of it the lane cancels
        ends its sending side with that."""
        self._receiver_ends[tid] = (code, reason)
        while len(self._receiver_ends) > 4096:
            self._receiver_ends.pop(next(iter(self._receiver_ends)))

    def forget(self, tid: str, rank: int) -> int:
        """This completion's copy into (tid, rank) is booked: the copies still pending there; the
        last one wakes the waiters (settle, a failed sibling's finalize)."""
        left = int(self.n.forget(tid, rank))
        if left == 0:
            self.wake((tid, rank))
        return left

    def wake(self, key: tuple[str, int]) -> None:
        """Nothing of the lane is pending in receiver rank ``key`` now: its waiters go on."""
        fut = self._waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def booked_all(self, key: tuple[str, int]) -> None:
        """Until every pending lane copy into receiver rank ``key`` is booked."""
        fut = self._waiters.get(key)
        if fut is None:
            fut = self._waiters[key] = asyncio.get_running_loop().create_future()
        await asyncio.shield(fut)

    async def _booked(self, tid: str, rank: int, ranks: list[int]) -> None:
        """Book this completion's copy into (tid, rank) now (``ranks`` loses it) and wait until
        every other pending copy there is booked."""
        ranks.remove(rank)
        if self.forget(tid, rank):
            await self.booked_all((tid, rank))
