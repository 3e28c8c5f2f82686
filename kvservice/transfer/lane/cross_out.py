"""The cross-node lane's sending side (docs/decisions/0018): a receiver's offer with a lane
slot arms the native lane for that transfer (an engine here may SEND_TO it); the native thread's
END comes back here to book the sender's record and its duplicate marks. A stream's chunks
before its last are booked as they are written (the record follows it: Poll, WatchTransfers),
and the sending engine's Abort between chunks ends it here (the lane holds no Python side)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt
from kvservice_client import Layout, lane_wire

from ...errors import FailedPrecondition
from .geometry import row_table

if TYPE_CHECKING:
    from ..engine import TransferEngine
    from ..peers import PeerClient
    from ..records import Record
    from ._native_api import Completion, NativeLane
    from ._plan_api import LanePlan
    from .book import LaneBook

__all__ = ["CrossOut"]

_ABORT_WAIT_S = 60.0
# an offer armed here: (receiver's address, its buffer set if it publishes, prefix pages, page size)
_Offer = tuple[str, str, int, int]
_NONE: _Offer = ("", "", 0, 0)
_NO_ROWS = np.zeros((0, 4), dtype=np.uint64)
_NO_PAGES = np.zeros(0, dtype=np.uint64)


def _skipped(offer: _Offer, rec: Record, e: TransferEngine, first: int, n: int) -> int:
    """Of ``n`` sender pages from transfer page ``first``, those inside the receiver's prefix
    (counted in the sender's pages: the page sizes may differ)."""
    prefix, page = offer[2], offer[3]
    bs = cast("LaneBook", e.lane).pool(rec.buffer_set_id)
    mine = bs.layout.page_size if bs is not None else page
    if page and mine and page != mine:
        prefix = prefix * page // mine
    return min(max(0, prefix - first), n)


class CrossOut:
    """Offers armed and sends booked on the sending side of one service's lane."""

    def __init__(self, engine: TransferEngine, native: NativeLane, agents: dict[str, str]) -> None:
        self.e = engine
        self.n = native
        self._agents = agents  # the book's: peer service id -> its lane agent
        # (transfer, rank) offered to an engine here -> (receiver's address, its buffer set if it
        # publishes the pages: the duplicate mark a DONE sets, as on the gRPC route, its prefix
        # and page size: a page-size conversion counts the sender's pages of that prefix)
        self._out: dict[str, dict[int, _Offer]] = {}  # transfer -> rank -> that
        self._recs: dict[tuple[str, str], Record] = {}  # (transfer, sender bs) -> a stream's record
        # (transfer, sender bs) the engine aborted -> (code, reason, resolved with the record)
        self._aborting: dict[tuple[str, str], tuple[str, str, asyncio.Future[Record]]] = {}
        self._rows_sent: set[int] = set()  # receiver geometry signatures the native lane holds rows of
        self.n_sent = 0  # transfers booked
        self.n_failed = 0

    def offered(self, address: str, peer: PeerClient, plan: LanePlan) -> None:
        """An offer with a lane slot arrived on our channel to ``address``: an engine here may
        SEND_TO it now."""
        s = plan.lane_slot
        agent = self._agents.get(peer.service_id)
        if not plan.HasField("lane_slot") or not s.agent or agent != s.agent:
            self.n.refuse_out(plan.transfer_id, plan.dst_layout.tp_rank)  # a waiting SEND_TO: gRPC now
            return
        deadline = time.monotonic() + plan.remaining_ms / 1000
        rank = plan.dst_layout.tp_rank
        into = plan.dst_buffer_set_id if plan.publishes else ""
        page = int(plan.dst_layout.page_size)
        self._out.setdefault(plan.transfer_id, {})[rank] = (address, into, int(plan.prefix_pages), page)
        rows, pages = self._receiver_rows(plan)
        self.n.arm_out(
            plan.transfer_id,
            plan.dst_layout.tp_rank,
            address,
            agent,
            s.address,
            s.size_bytes,
            s.device_id,
            1 if s.mem_kind == "VRAM" else 0,
            s.signature,
            plan.prefix_pages,
            len(plan.dst_page_indices),
            deadline,
            s.unit_signature,  # (page sizes that differ: units of their gcd, decision 0027)
            page,
            s.row_signature,  # (page layouts that differ: packed in the receiver's, decision 0029)
            rows,
            pages,
        )

    def _receiver_rows(self, plan: LanePlan) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """The receiver pool's head rows and each region's page bytes, from its layout, for the
        native lane's first offer of that receiver geometry (it keeps them by the offer's geometry
        signature: later offers send none)."""
        s = plan.lane_slot
        if not s.row_signature or s.signature in self._rows_sent:
            return _NO_ROWS, _NO_PAGES
        self._rows_sent.add(s.signature)
        lay = Layout.from_proto(plan.dst_layout)  # type: ignore[arg-type]  # (a peer_pb2 Layout)
        one = lay.num_v_regions == 0  # K and V in one region a layer
        k = lay.page_bytes_k + (lay.page_bytes_v if one and lay.kind == "mha" else 0)
        pages = np.array([k] * lay.num_layers + [lay.page_bytes_v] * lay.num_v_regions, dtype=np.uint64)
        return row_table(lay)[1], pages

    def holds_offer(self, transfer_id: str) -> bool:
        """Whether an offer of ``transfer_id`` is armed here (an engine here may SEND_TO it)."""
        return transfer_id in self._out

    def gate_out(self, transfer_id: str, rank: int) -> None:
        """A SendDelta of sender rank ``rank`` over gRPC: the lane gives it up, or refuses."""
        if self.n.disarm_out(transfer_id, rank) == 2:
            raise FailedPrecondition(f"transfer_id: {transfer_id!r} is being sent on the cross-node lane")
        self._forget_out(transfer_id, rank)

    def _forget_out(self, transfer_id: str, rank: int) -> _Offer:
        ranks = self._out.get(transfer_id, {})
        got = ranks.pop(rank, _NONE)
        if not ranks:
            self._out.pop(transfer_id, None)
        return got

    def drop_out(self, transfer_id: str) -> None:
        """The receiver ended ``transfer_id``: no SEND_TO of it is taken from now on (one already
        writing ends with the receiver's refusal, and its completion forgets the rest)."""
        for rank in list(self._out.get(transfer_id, ())):  # every rank armed here is in _out
            if self.n.disarm_out(transfer_id, rank) != 2:
                self._forget_out(transfer_id, rank)

    def _record(self, tid: str, bs_id: str, session_id: str) -> Record:
        from ..records import Record

        rec = self._recs.pop((tid, bs_id), None)
        if rec is None:
            rec = Record(tid, "SENDER", bs_id, session_id, time.monotonic() + 60)
            rec.route_note = "cross-node lane"
            self.e.table.add(rec)
        return rec

    def _count(
        self, rec: Record, tid: str, rank: int, src: npt.NDArray[np.int32], first: int, nbytes: int, us: int
    ) -> None:
        """``src`` (from transfer page ``first``) on ``rec``: the prefix pages among them skipped."""
        skipped = _skipped(self._out.get(tid, {}).get(rank, _NONE), rec, self.e, first, len(src))
        self.e.table.update(
            rec,
            state="TRANSFERRING",
            add_bytes_sent=nbytes,
            add_pages_sent=len(src) - skipped,
            add_pages_skipped=skipped,
            add_wire=us,
            path="PACKED",
        )

    def chunk(self, c: Completion) -> None:
        """A chunk of a stream written before its last: the sender's record shows it."""
        tid, rank, bs_id, session_id, src, _, _, nbytes, copy_us = c[:9]
        rec = self._record(tid, bs_id, session_id)
        self._recs[(tid, bs_id)] = rec
        self._count(rec, tid, rank, src, int(c[14]), nbytes, copy_us)

    async def abort(self, session_id: str | None, transfer_id: str, code: str, reason: str) -> list[Record]:
        """The sending engine's Abort of ``transfer_id``: its cross-node streams still taking
        chunks end (the receiving service hears it at once); their records once booked."""
        if session_id is None:
            return []
        waits = []
        for bs_id in self.n.abort_xstreams(session_id, transfer_id, f"aborted by the sender: {reason}"):
            fut = asyncio.get_running_loop().create_future()
            self._aborting[(transfer_id, bs_id)] = (code, reason, fut)
            waits.append(fut)
        # NOTE: a stream with a WRITE in flight ends once it is done (at most its deadline); a
        # lane that stops meanwhile books nothing more: then the records as they are
        done, _ = await asyncio.wait(waits, timeout=_ABORT_WAIT_S) if waits else (set(), set())
        return [f.result().snapshot() for f in waits if f in done]

    async def sent(self, c: Completion) -> None:
        """The native thread's END to a sending engine: book the sender's side (its record, for
        Poll and the Transfers stream; the engine read its END on the lane already)."""
        tid, rank, bs_id, session_id, src, ok, error, nbytes, copy_us, flags, _, told_send = c[:12]
        e = self.e
        self.n.forget_out(tid, rank)
        offer = self._forget_out(tid, rank)
        address, publishes_into = offer[0], offer[1]
        # NOTE: the offer is spent: a later SendDelta of this id (a retry after DONE) must not write
        # with its plan into pages the receiver may own again; it asks, and the receiver refuses
        bs = cast("LaneBook", e.lane).pool(bs_id)  # (the engine's lane is the book of this one)
        chan = e.dispatch.channels.get(address)
        if chan is not None:
            chan.offers.consume(tid, bs.layout.tp_rank if bs is not None else None)
        rec = self._record(tid, bs_id, session_id)
        rec.lane_told = told_send
        aborting = self._aborting.pop((tid, bs_id), None)
        if not ok:
            self.n_failed += 1
            if aborting is not None:
                code, reason, fut = aborting
                e.table.finish(rec, "ABORTED" if code == "ABORTED" else "FAILED", code, reason)
                fut.set_result(rec)
            else:
                e.table.finish(rec, "FAILED", "UNAVAILABLE", f"cross-node lane: {error}")
            return
        if aborting is not None:  # its last chunk was written before the Abort came: it is DONE
            aborting[2].set_result(rec)
        # what the chunk bookings did not count yet (the END's figures are the whole stream's)
        first = int(c[14])  # the transfer page of src[0] (a stream may start inside the prefix)
        skipped = _skipped(offer, rec, e, first, len(src))
        e.table.update(
            rec,
            state="TRANSFERRING",
            add_bytes_sent=nbytes - rec.bytes_sent,
            add_pages_sent=len(src) - skipped - rec.pages_sent,
            add_pages_skipped=skipped - rec.pages_skipped,
            add_descriptors=1,
            add_wire=copy_us - rec.timings_us.get("wire", 0),
            path="PACKED",
        )
        e.table.finish(rec, "DONE")
        self.n_sent += 1
        if publishes_into and not flags & lane_wire.FLAG_NO_DUPLICATE_MARK:
            e.duplicates.mark(bs_id, np.asarray(src, dtype=np.int64), address, (publishes_into,))
