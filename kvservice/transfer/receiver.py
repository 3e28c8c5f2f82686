"""Receiver side: declarations (ExpectDelta), receive plans for senders, staging slots, commits.

A declaration is one receiver rank's view of transfer T. Senders find it through
``plans`` (which waits, within the deadline, until every rank they route to has declared),
reserve staging slots for packed chunks, write, then ``commit``: packed chunks are unpacked
here into the engine's pages; direct chunks already landed. DONE when every expected sender
committed its last chunk covering all delta pages and the declared aux rows arrived. Which
sender may bind to a declaration, and prove it at each commit, is ``sender_binding``.

    expected senders (derived from the layouts; H heads, sender TP p, receiver TP d):
      MHA p <= d: 1     MHA p > d: p/d     replicated heads / MLA: 1 (one replica sends)
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from kvservice_client import Layout

from ..buffers import BufferSet, MappedRegion
from ..errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from ..kernels import KVRegions
from ..kernels.heads import HeadRoute, plan_heads
from ..staging import Slot, StagingPool
from .plan import Units
from .records import Record, TransferTable
from .sender_binding import Offer, SenderBinding, check_compatible, ticket_matches
from .values import Plan, Region

if TYPE_CHECKING:
    from .landing import Entry

__all__ = ["Incoming", "Offer", "Receiver", "check_compatible", "plan_of", "routes_for", "ticket_matches"]


@dataclasses.dataclass(eq=False)
class Incoming:
    """One receiver rank's declaration of a transfer and its progress."""

    rec: Record
    bs: BufferSet
    prefix_pages: int
    dst_pages: np.ndarray
    aux: dict[str, np.ndarray]
    expected_senders: int
    publish_hashes: np.ndarray | None
    prefix_page_indices: np.ndarray
    publish_tokens: np.ndarray | None = None  # u32, when the receiver published by tokens
    covered: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # sender key -> units
    units: dict[str, Units] = dataclasses.field(default_factory=dict)  # sender key -> its units here
    skipped_src: dict[str, int] = dataclasses.field(default_factory=dict)  # sender pages skipped so far
    finished: set[str] = dataclasses.field(default_factory=set)
    senders: dict[str, str] = dataclasses.field(default_factory=dict)  # service id -> address
    identities: dict[str, str] = dataclasses.field(default_factory=dict)  # service id -> peer identity
    allowed_senders: frozenset[str] = frozenset()  # ExpectDelta.allowed_senders (empty: any)
    tickets: dict[str, str] = dataclasses.field(default_factory=dict)  # sender key -> its secret
    offers: dict[str, Offer] = dataclasses.field(default_factory=dict)  # service id -> its offer
    integrity: bool = False  # commits must carry a checksum the receiver verifies
    slots: dict[int, tuple[StagingPool, Slot]] = dataclasses.field(default_factory=dict)
    aux_done: bool = False
    busy: int = 0  # copies and unpacks writing its pages now (enter / leave; an abort awaits quiet)
    _idle: asyncio.Event | None = dataclasses.field(default=None, repr=False)
    # A landing declaration (kvservice.transfer.landing): ``bs`` is then a view of the landing pool under the
    # engine's buffer set id, ``regions`` its KV regions, and completion is LANDED, not DONE.
    landing: Entry | None = None
    regions: KVRegions | None = None

    def holds_offer(self, ticket: str, identity: str | None = None) -> bool:
        """``ticket`` is one of this declaration's offers (given to ``identity``, when named)."""
        return any(
            ticket_matches(o.ticket, ticket) and identity in (None, o.identity) for o in self.offers.values()
        )

    def enter(self) -> None:
        """A copy or unpack starts writing this declaration's pages."""
        self.busy += 1

    def leave(self) -> None:
        """It ended: wakes whoever awaits :meth:`quiet` once none is left."""
        self.busy -= 1
        if not self.busy and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def quiet(self) -> None:
        """Return once no copy or unpack writes this declaration's pages (no polling)."""
        while self.busy:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()


def _region(r: MappedRegion) -> Region:
    return Region(r.address, r.size, r.mem_kind, r.device)


def plan_of(
    inc: Incoming, route: HeadRoute, direct_ok: bool, sender_key: str = "", addresses: bool = True
) -> Plan:
    """What sender rank ``sender_key`` needs to write into ``inc``'s pages, with its ticket
    (``addresses=False``: without the KV regions' addresses, for a sender in this very service,
    which copies into the regions themselves)."""
    bs = inc.bs
    return Plan(
        transfer_id=inc.rec.transfer_id,
        dst_buffer_set_id=bs.buffer_set_id,
        dst_layout=bs.layout,
        prefix_pages=inc.prefix_pages,
        dst_pages=inc.dst_pages,
        route=route,
        sender_ticket=inc.tickets.get(sender_key, ""),
        integrity=inc.integrity,
        direct_ok=direct_ok and inc.landing is None,  # NOTE: the landing pool is not registered
        publishes=inc.publish_hashes is not None and inc.landing is None,  # no P/D duplicate yet
        expected_senders=inc.expected_senders,
        remaining_ms=max(0, int((inc.rec.deadline - time.monotonic()) * 1000)),
        aux=inc.aux,
        kv_regions=tuple(_region(r) for r in bs.regions) if addresses else (),
        aux_regions=tuple(_region(a.region) for a in bs.aux),
        aux_row_bytes=tuple(a.row_bytes for a in bs.aux),
        aux_names=tuple(a.name for a in bs.aux),
    )


def routes_for(src: Layout, dst_tp: int) -> list[HeadRoute]:
    """Head routes of the sender rank ``src.tp_rank`` towards a receiver of TP ``dst_tp``."""
    return [r for r in plan_heads(src.total_kv_heads, src.tp_size, dst_tp) if r.src_rank == src.tp_rank]


REFUSED_KEEP_S = 60.0  # how long a refused declaration answers its sender's plan request
REFUSED_MAX = 4096


class Receiver:
    """All declarations of this service; every method runs on the event loop."""

    def __init__(self, table: TransferTable, pool_for: Callable[[BufferSet], StagingPool]) -> None:
        self.table = table
        self._pool_for = pool_for
        self.incoming: dict[tuple[str, str], Incoming] = {}  # (transfer_id, bs_id)
        self._by_tid: dict[str, dict[str, Incoming]] = {}  # transfer_id -> bs_id -> declaration
        # NOTE: waiters per transfer id, woken by that id's declarations only: one condition for
        # every pending plan woke all of them at each ExpectDelta (a herd under many senders).
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self.senders = SenderBinding(table)  # who may send each declaration (offer, bind, check)
        # refused declarations: transfer_id -> (the sender they named, why, until when)
        self._refused: collections.OrderedDict[str, tuple[str, str, float]] = collections.OrderedDict()

    # -- ExpectDelta -------------------------------------------------------------------------
    async def expect(self, inc: Incoming) -> None:
        key = (inc.rec.transfer_id, inc.bs.buffer_set_id)
        old = self.incoming.get(key)
        if old is not None and not old.rec.terminal:
            raise AlreadyExists(f"transfer_id: {key[0]!r} is already declared for buffer set {key[1]!r}")
        tp = inc.bs.layout.tp_size
        for other in self.of(inc.rec.transfer_id):
            if not other.rec.terminal and (
                other.bs.layout.tp_size != tp or other.bs.layout.tp_rank == inc.bs.layout.tp_rank
            ):
                if other.rec.session_id != inc.rec.session_id:  # NOTE: name only the caller's own objects
                    raise FailedPrecondition(f"transfer_id: {key[0]!r} is in use by another client")
                raise FailedPrecondition(
                    f"transfer_id: {key[0]!r} is already declared by TP rank {other.bs.layout.tp_rank}/"
                    f"{other.bs.layout.tp_size} (buffer set {other.bs.buffer_set_id})"
                )
        self._refused.pop(key[0], None)  # declared after all (a retry): its senders may bind
        self.incoming[key] = inc
        self._by_tid.setdefault(key[0], {})[key[1]] = inc
        self.table.add(inc.rec)
        self._wake(key[0])

    def refuse(self, transfer_id: str, sender_address: str, why: str) -> None:
        """An ExpectDelta of ``transfer_id`` naming ``sender_address`` ("": none, so any sender
        could have fetched its plan) was refused (``why``) and no rank declared it: that sender's
        plan request, which may be waiting already (an engine may post its room before the
        declaration), fails now with the reason instead of at its deadline (``plans``). Kept
        ``REFUSED_KEEP_S`` (at most ``REFUSED_MAX`` of them); a later declaration clears it."""
        if not transfer_id or transfer_id in self._by_tid:
            return
        self._refused[transfer_id] = (sender_address, why, time.monotonic() + REFUSED_KEEP_S)
        self._refused.move_to_end(transfer_id)
        while len(self._refused) > REFUSED_MAX:
            self._refused.popitem(last=False)
        self._wake(transfer_id)

    def _wake(self, transfer_id: str) -> None:
        """Every plan request waiting for ``transfer_id`` looks again (``plans``)."""
        for fut in self._waiters.pop(transfer_id, ()):
            if not fut.done():
                fut.set_result(None)

    def _refusal(self, transfer_id: str, sender_address: str) -> str | None:
        """Why ``transfer_id``'s declaration was refused, if it named ``sender_address`` or no
        sender (None: not refused, another sender named, or forgotten)."""
        hit = self._refused.get(transfer_id)
        if hit is None:
            return None
        if hit[2] < time.monotonic():
            del self._refused[transfer_id]
            return None
        return hit[1] if hit[0] in ("", sender_address) else None

    def of(self, transfer_id: str) -> list[Incoming]:
        """The declarations of ``transfer_id`` (every rank), in O(their number)."""
        return list(self._by_tid.get(transfer_id, {}).values())

    def forget(self, key: tuple[str, str]) -> None:
        """Drop a finished declaration (the table pruned its record)."""
        inc = self.incoming.pop(key, None)
        if inc is None:
            return
        per = self._by_tid.get(key[0])
        if per is not None and per.get(key[1]) is inc:
            del per[key[1]]
            if not per:
                del self._by_tid[key[0]]

    # -- GetReceivePlan ----------------------------------------------------------------------
    async def plans(
        self, transfer_id: str, src: Layout, sender_id: str, sender_address: str, wait_s: float, identity: str
    ) -> list[tuple[Incoming, HeadRoute]]:
        """Wait until the ranks this sender routes to have declared; return them with routes.
        A sender whose peer ``identity`` a declaration does not allow is refused (the transfer
        goes on: the allowed sender may still come)."""
        deadline = time.monotonic() + wait_s

        def ready() -> list[tuple[Incoming, HeadRoute]] | None:
            live = self.of(transfer_id)
            if not live:
                return None
            dst_tp = live[0].bs.layout.tp_size
            by_rank = {i.bs.layout.tp_rank: i for i in live}
            wanted = routes_for(src, dst_tp)
            if any(r.dst_rank not in by_rank for r in wanted):
                return None
            return [(by_rank[r.dst_rank], r) for r in wanted]

        while (found := ready()) is None:
            why = None if transfer_id in self._by_tid else self._refusal(transfer_id, sender_address)
            if why is not None:
                raise FailedPrecondition(
                    f"transfer_id: the receiver refused the declaration of {transfer_id!r}: {why}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise NotFound(f"transfer_id: receiver never declared {transfer_id!r} (waited {wait_s:.3f}s)")
            await self._declared(transfer_id, left)
        key = f"{sender_id}/{src.tp_rank}"
        for inc, _ in found:
            self.senders.may_bind(inc, transfer_id, key, sender_id, identity)
        for inc, _ in found:
            self.senders.bind(inc, src, key, sender_id, sender_address, identity, secrets.token_hex(16))
        return found

    async def _declared(self, transfer_id: str, timeout: float) -> None:
        """Until a rank declares ``transfer_id`` or ``timeout`` seconds passed."""
        fut = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(transfer_id, [])
        waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            still = self._waiters.get(transfer_id)
            if still is not None and fut in still:
                still.remove(fut)
                if not still:
                    del self._waiters[transfer_id]

    def get(self, transfer_id: str, bs_id: str) -> Incoming:
        inc = self.incoming.get((transfer_id, bs_id))
        if inc is None:
            raise NotFound(f"transfer_id: no declaration of {transfer_id!r} for buffer set {bs_id!r}")
        if inc.rec.terminal:
            raise Aborted(f"transfer {transfer_id!r} is {inc.rec.state}: {inc.rec.error}")
        return inc

    # -- ReserveStaging ----------------------------------------------------------------------
    async def reserve(
        self, transfer_id: str, bs_id: str, nbytes: int, identity: str, ticket: str = ""
    ) -> tuple[StagingPool, Slot]:
        """Room for one packed chunk, for a peer that fetched the transfer's plan (as ``identity``)."""
        inc = self.get(transfer_id, bs_id)
        if not inc.holds_offer(ticket, identity) and (
            identity not in inc.identities.values()
            or not any(ticket_matches(t, ticket) for t in inc.tickets.values())
        ):
            raise PermissionDenied(
                f"transfer_id: no sender of {transfer_id!r} fetched its plan as peer {identity!r} "
                "with this sender_ticket"
            )
        pool = self._pool_for(inc.bs)
        slot = await pool.reserve(nbytes, inc.rec.deadline)
        if inc.rec.terminal:  # aborted while we waited
            pool.release(slot)
            raise Aborted(f"transfer {transfer_id!r} is {inc.rec.state}: {inc.rec.error}")
        inc.slots[slot.serial] = (pool, slot)
        return pool, slot

    def release_slots(self, inc: Incoming) -> None:
        for pool, slot in inc.slots.values():
            pool.release(slot)
        inc.slots.clear()

    # -- CommitChunk -------------------------------------------------------------------------
    def record_chunk(
        self,
        inc: Incoming,
        sender_key: str,
        positions: np.ndarray,
        last: bool,
        nbytes: int,
        skipped: int,
        aux: bool,
        primary: bool = True,
    ) -> None:
        """Account a landed chunk (``positions`` in the sender's units); on a sender's last chunk
        check it covered every delta page (but a tail of the last one, see ``Units.unsent_ok``).

        With sender TP > receiver TP several senders deliver head slices of the same pages: pages
        count once, from the ``primary`` sender (the one writing the rank's first head).
        """
        cov = inc.covered.get(sender_key)
        if cov is None:
            raise FailedPrecondition(f"sender {sender_key} committed without fetching the plan")
        units = inc.units[sender_key]
        rel = positions - inc.prefix_pages * units.dst_per_page
        if rel.size and (rel.min() < 0 or rel.max() >= cov.size):
            raise InvalidArgument("positions", f"outside the declared delta 0..{cov.size - 1}")
        cov[rel] = True
        inc.aux_done |= aux
        # NOTE: page counts are the receiver's pages: a position is one when a unit is a page here;
        # else the pages touched count once, at the sender's end, and the sender's skipped pages
        # (its own size) convert through units.
        md, same = units.dst_per_page, units.src_per_page == units.dst_per_page == 1
        if primary and not same:
            inc.skipped_src[sender_key] = inc.skipped_src.get(sender_key, 0) + skipped
        self.table.update(
            inc.rec,
            add_bytes_sent=nbytes,
            add_pages_sent=int(positions.size) if primary and md == 1 else 0,
            add_pages_skipped=skipped if primary and same else 0,
            add_chunks_done=int(positions.size > 0),
        )
        if not last:
            return
        if primary and not same:
            self.table.update(
                inc.rec,
                add_pages_sent=int(np.count_nonzero(cov.reshape(-1, md).any(axis=1))) if md > 1 else 0,
                add_pages_skipped=inc.skipped_src.pop(sender_key, 0) * units.src_per_page // md,
            )
        if not units.unsent_ok(cov):
            missing = int(cov.size - np.count_nonzero(cov))
            what = "delta pages" if units.dst_per_page == 1 else f"delta units of {units.tokens} tokens"
            raise FailedPrecondition(
                f"sender {sender_key} finished with {missing} of {cov.size} {what} unsent"
            )
        inc.finished.add(sender_key)
        self.table.update(inc.rec, senders_done=len(inc.finished))

    def complete_if_done(self, inc: Incoming) -> bool:
        if len(inc.finished) < max(inc.expected_senders, 1) or inc.busy:
            return False
        if inc.aux and not inc.aux_done:
            self.table.finish(
                inc.rec,
                "FAILED",
                "FAILED_PRECONDITION",
                "every sender finished but no sender delivered the declared aux rows",
            )
            return False
        if inc.landing is not None:  # LANDED; a Claim makes it DONE (nothing to publish now)
            inc.landing.landed(inc)
            return False
        return self.table.finish(inc.rec, "DONE")
