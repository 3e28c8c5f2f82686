"""Every way a transfer ends before its last commit: Abort, a peer's Abort, a failure, the deadline.

    Abort (engine)        ─▶ its sides here stop: a sender settles its writes first, then tells the
                             receiver; a receiver waits for its unpack, frees staging, tells its senders
    Abort (peer)          ─▶ only the sides that peer is a party to (parties.py)
    a failed commit       ─▶ fail_incoming: the receiver ends and tells its senders
    the sender's channel  ─▶ sender_gone: its receivers end now, not at their deadline
    the deadline          ─▶ the reaper (every 10 ms) ends what passed it; every second it drops
                             the working state of sides ended STATE_GRACE_S ago, prunes finished
                             records, expires index leases and idle peer pool mappings
    a session or buffer set goes ─▶ its transfers are aborted

Every path ends with the record terminal (DONE / FAILED / ABORTED with a reason) and no staging
slot, landing or in-flight write left behind.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import InvalidArgument, KVServiceError, NotFound
from ..index import PrefixIndex
from .dispatch import Dispatch
from .lane.book import NoLane
from .parties import may_abort_in, may_abort_out
from .peer_serving import tell_sender
from .receiver import Incoming, Receiver
from .records import Record, TransferTable
from .sender import Outgoing, Sender

if TYPE_CHECKING:
    from .landing import LandingBook

__all__ = ["STATE_GRACE_S", "Ends"]

# NOTE: an ended side's working state (its Outgoing / Incoming with their task, plans and page
# arrays: ~25 objects the cyclic GC tracks) goes this long after its end; its record (what Poll
# and WatchTransfers answer) stays ``transfer_retain_s``. Kept as long as the records, at 2,000
# transfers/s it was ~15M tracked objects and full collections of seconds.
STATE_GRACE_S = 5.0


class Ends:
    def __init__(
        self,
        service_id: str,
        table: TransferTable,
        sender: Sender,
        receiver: Receiver,
        dispatch: Dispatch,
        lane: Callable[[], NoLane],
        landing: LandingBook,
        index: PrefixIndex,
    ) -> None:
        self.service_id = service_id
        self.table = table
        self.sender = sender
        self.receiver = receiver
        self.dispatch = dispatch
        self.peers = dispatch.peers
        self._lane = lane  # NOTE: looked up per use: kvservice.transfer.lane.start replaces the engine's lane
        self._landing = landing
        self._index = index
        self._reaper: asyncio.Task[None] | None = None
        self._reaping: set[tuple[str, str, str]] = set()
        self._ended: collections.deque[tuple[float, tuple[str, str, str]]] = collections.deque()
        table.terminal_listeners.append(lambda rec: self._ended.append((rec.ended, rec.key)))

    async def abort(
        self,
        session_id: str | None,
        transfer_id: str,
        code: str,
        reason: str,
        notify: bool = True,
    ) -> list[Record]:
        """Stop every side of ``transfer_id`` (of ``session_id`` if given); settled on return.
        (A peer's abort goes through :meth:`abort_from_peer`.)"""
        if not transfer_id:
            raise InvalidArgument("transfer_id", "is required")
        outs = [
            o for o in self.sender.of(transfer_id) if session_id is None or o.rec.session_id == session_id
        ]
        incs = [
            i for i in self.receiver.of(transfer_id) if session_id is None or i.rec.session_id == session_id
        ]
        if not outs and not incs:
            # a cross-node stream between its chunks (only the lane holds it), or one that ended a
            # while ago (its working state went): its records say how
            if session_id is not None and (
                lane := await self._lane().abort_sender(session_id, transfer_id, code, reason)
            ):
                return list(lane)
            ended = [
                r for r in self.table.find(transfer_id) if session_id is None or r.session_id == session_id
            ]
            if session_id is not None and not ended:
                raise NotFound(f"transfer_id: no transfer {transfer_id!r} of this client on this service")
            return [r.snapshot() for r in ended if r.terminal]
        await asyncio.gather(
            *(
                self._abort_out(o, code, reason, notify and bool(self.peers.get(o.peer_address).service_id))
                for o in outs
            ),
            *(self._abort_in(i, code, reason, notify) for i in incs),
        )
        return [o.rec.snapshot() for o in outs] + [i.rec.snapshot() for i in incs]

    async def abort_from_peer(
        self,
        transfer_id: str,
        code: str,
        reason: str,
        origin: str,
        identity: str,
        ticket: str = "",
        senders: bool = True,
    ) -> bool:
        """A peer's Abort: only the sides of ``transfer_id`` that peer is a party to stop (see
        :func:`parties.may_abort_in` / :func:`parties.may_abort_out`); ``senders=False``: only
        receiver sides (a sender of this very service telling its receivers it stopped).
        Returns whether any side stopped."""
        outs = (
            []
            if not senders
            else [
                o
                for o in self.sender.of(transfer_id)
                if self.peers.get(o.peer_address).service_id == origin and may_abort_out(o, identity, ticket)
            ]
        )
        incs = [i for i in self.receiver.of(transfer_id) if may_abort_in(i, origin, identity, ticket)]
        dropped = senders and not outs and self.dispatch.drop_offer(origin, transfer_id, ticket)
        await asyncio.gather(
            *(self._abort_out(o, code, reason, False) for o in outs),
            *(self._abort_in(i, code, reason, True, origin) for i in incs),
        )
        return bool(outs or incs or dropped)

    async def _abort_out(self, out: Outgoing, code: str, reason: str, notify: bool) -> None:
        self.sender.stop(out, code, reason)  # the lane's booking is not stopped: waited for (DONE)
        await self.sender.stopped(out)
        state = "ABORTED" if code == "ABORTED" else "FAILED"
        if self.table.finish(out.rec, state, code, reason) and notify:
            await self.dispatch.tell_abort(out, code, reason)

    async def _abort_in(self, inc: Incoming, code: str, reason: str, notify: bool, origin: str = "") -> None:
        await self._lane().settle(inc, code, reason)  # disarmed, or the lane's copy is booked (then DONE)
        state = "ABORTED" if code == "ABORTED" else "FAILED"
        landed = inc.rec.state == "LANDED"  # its senders are done: nobody to tell
        if not self.table.finish(inc.rec, state, code, reason):
            return
        if notify and not landed:  # senders settle their in-flight writes before they answer
            told = [
                (inc.senders[svc], ticket)
                for key, ticket in inc.tickets.items()
                if (svc := key.rpartition("/")[0]) != origin and svc in inc.senders
            ] + [  # offered, not bound yet: it may be writing already (or drops the offer)
                (o.address, o.ticket)
                for svc, o in inc.offers.items()
                if svc != origin and o.ticket not in inc.tickets.values()
            ]
            await asyncio.gather(
                *(
                    tell_sender(
                        self.peers, self.service_id, address, inc.rec.transfer_id, code, reason, ticket
                    )
                    for address, ticket in told
                )
            )
        await inc.quiet()  # an unpack or copy in progress finishes first
        self.receiver.release_slots(inc)
        if inc.landing is not None:  # its landing-pool bytes are free when the abort returns
            self._landing.release(inc.landing)

    async def sender_gone(self, sender_service_id: str, why: str) -> None:
        """A sending service's channel ended: its live incoming transfers fail now (UNAVAILABLE)."""
        for inc in list(self.receiver.incoming.values()):
            if not inc.rec.terminal and inc.rec.state != "LANDED" and sender_service_id in inc.senders:
                await self._abort_in(inc, "UNAVAILABLE", f"sender {sender_service_id}: {why}", notify=False)

    async def fail_incoming(self, inc: Incoming, exc: KVServiceError) -> None:
        await self._abort_in(inc, exc.code.name, exc.message, True)

    async def abort_buffer_set(self, bs_id: str) -> int:
        recs = [r for r in self.table.live() if r.buffer_set_id == bs_id]
        for tid in {r.transfer_id for r in recs}:
            await self.abort(None, tid, "ABORTED", f"buffer set {bs_id} unregistered")
        return len(recs)

    async def release_session(self, session_id: str) -> None:
        recs = [r for r in self.table.live() if r.session_id == session_id]
        for tid in {r.transfer_id for r in recs}:
            await self.abort(session_id, tid, "ABORTED", "the owning client went away")

    async def abort_all(self, reason: str) -> None:
        for tid in {r.transfer_id for r in self.table.live()}:
            await self.abort(None, tid, "ABORTED", reason)

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="transfer-reaper")

    def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()

    async def _reap(self) -> None:
        """Every 10 ms: fail live transfers past their deadline; every second: prune and expire."""
        tick = 0
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            for rec in self.table.live():
                if rec.deadline < now and rec.key not in self._reaping:
                    self._reaping.add(rec.key)
                    asyncio.ensure_future(self._expire(rec))
            tick += 1
            if tick % 100 == 0:
                grace = now - min(STATE_GRACE_S, self.table.retain_s)
                while self._ended and self._ended[0][0] < grace:
                    self._forget(self._ended.popleft()[1])
                for key in self.table.prune():  # a record added already ended never told us
                    self._forget(key)
                self._index.expire_leases()
                self.dispatch.peer_pools.expire()

    async def _expire(self, rec: Record) -> None:
        key = (rec.transfer_id, rec.buffer_set_id)
        why = "transfer deadline passed"
        try:
            if rec.role == "SENDER" and key in self.sender.outgoing:
                await self._abort_out(self.sender.outgoing[key], "DEADLINE_EXCEEDED", why, True)
            elif rec.role == "RECEIVER" and key in self.receiver.incoming:
                await self._abort_in(self.receiver.incoming[key], "DEADLINE_EXCEEDED", why, True)
            else:
                self.table.finish(rec, "FAILED", "DEADLINE_EXCEEDED", why)
        finally:
            self._reaping.discard(rec.key)

    def _forget(self, key: tuple[str, str, str]) -> None:
        tid, _, bs_id = key
        out = self.sender.outgoing.get((tid, bs_id))
        if out is not None and out.rec.key == key and out.rec.terminal:
            self.sender.forget((tid, bs_id))
        inc = self.receiver.incoming.get((tid, bs_id))
        if inc is not None and inc.rec.key == key and inc.rec.terminal:
            self.receiver.forget((tid, bs_id))
