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
from typing import Any

import numpy as np

from ..errors import KVServiceError
from .cross_in import CANCELLED

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

    def __init__(self, book: Any) -> None:
        self.book = book
        self.e = book.e
        self.n = book.n
        self._waiters: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0  # transfers the lane moved (finalized)
        self.failed = 0

    def on_completions(self) -> None:
        """The native thread's completion fd is readable: book each completion in a task."""
        for c in self.n.drain():
            kind = c[-1]
            work = self._finalize(*c[:-1]) if kind == 0 else self._cross_done(kind, c)
            task = asyncio.get_running_loop().create_task(work, name=f"lane-{c[0]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _cross_done(self, kind: int, c: tuple[Any, ...]) -> None:
        """A cross-node completion (cross.py): 1 = sent (this side's engine had its END), 2 =
        received into a declaration here."""
        tid, rank = c[0], c[1]
        try:
            if kind == 1:
                await self.book.cross.tx.sent(c)
            else:
                _BOOKING.set((tid, (rank,)))  # this task's own context (create_task copied it)
                await self.book.cross.rx.received(tid, rank, c[5], c[6], c[7], c[8], c[10])
        except Exception:
            log.exception("cross-node lane finalize failed", extra={"transfer_id": tid})
        finally:
            if kind != 1:
                self.wake((tid, rank))
            self.book.cross.log_trace()

    async def _finalize(
        self,
        tid: str,
        rank: int,
        bs_id: str,
        session_id: str,
        src: np.ndarray,
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
        """Book one sender's stream the lane copied into receiver ranks ``ranks``: its chunks'
        pages ``src`` from transfer page ``first`` on, and ``aux_rows`` aux rows (``told``: which
        ranks heard their END with it: their last sender)."""
        from ..transfer.records import Record
        from ..transfer.sender import Chunk, Outgoing

        e = self.e
        ranks = list(ranks)  # (``rank``, ``told_recv``: its first, the cross-node completions' fields)
        told_by = dict(zip(ranks, told, strict=True))
        # NOTE: in this task's own context (create_task copied it), inherited by the tasks it
        # starts: the booking's sender worker, and whatever that worker ends (see settle).
        _BOOKING.set((tid, tuple(ranks)))
        incs = [i for i in e.receiver.of(tid) if i.bs.layout.tp_rank in told_by]
        bs = self.book.pool(bs_id)
        try:
            deadline = incs[0].rec.deadline if incs else time.monotonic() + 60
            rec = Record(tid, "SENDER", bs_id, session_id, deadline)
            # an engine the lane told has its END: its Transfers stream need not say it again
            rec.lane_told = told_send
            for inc in incs:
                inc.rec.lane_told = inc.rec.lane_told or bool(told_by.get(inc.bs.layout.tp_rank))
            if ok and bs is not None and len(incs) == len(ranks):
                # the booking: the ordinary same-node send of a copy already made, on this
                # service's own declarations; nothing stops it and nothing in it waits (an end
                # that meets it waits for it: Sender.stop)
                out = Outgoing(rec, bs, e.address, "auto", no_duplicate_mark=bool(flags & 1), via_lane=True)
                out.seq, out.next_offset, out.got_last = 1, int(first + src.size), True
                each = (nbytes // len(ranks), copy_us)  # per receiver rank (even head splits)
                chunk = Chunk(
                    0,
                    int(first),
                    src.astype(np.int64),
                    True,
                    {},
                    time.monotonic(),
                    copied=each,
                    copied_aux=aux_rows // len(ranks),
                )
                await e.send(out, chunk)
                await e.sender.stopped(out)
                if rec.state == "DONE":
                    self.sent += 1
                else:
                    self.failed += 1
                return
            self.failed += 1
            if error == CANCELLED:  # the receiver ended it mid-stream: its own end is being booked
                e.table.add(rec)
                why = "the receiver ended the transfer before its last chunk"
                e.table.finish(rec, "FAILED", "ABORTED", why)
                return
            why = error or (
                "the sender's buffer set is gone" if bs is None else "the receiver's declaration is gone"
            )
            e.table.add(rec)
            e.table.finish(rec, "FAILED", "INTERNAL", f"lane copy failed: {why}")
            for inc in incs:
                # another sender's copy into this rank may still run: its booking first, so the
                # rank ends FAILED only once nothing writes its pages (the lane's END waits too)
                await self._booked(tid, inc.bs.layout.tp_rank, ranks)
                await e.fail_incoming(inc, KVServiceError(f"lane copy failed: {why}"))
        except Exception:
            log.exception("lane finalize failed", extra={"transfer_id": tid})
        finally:
            for r in ranks:
                self.forget(tid, r)

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
