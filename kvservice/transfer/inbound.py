"""The receiver's half of a commit: unpack, verify, account, DONE and publish.

    commit (a sender rank's Commit, from LocalReceiver or peer_serving)
      │ PACKED:  staging slot / channel credit ─▶ [checksum verdict] ─▶ unpack into the pages
      │ DIRECT / FUSED: the bytes are already in the pages ─▶ [checksum of the landed pages]
      ▼
    Receiver.record_chunk (coverage, counts) ─▶ complete_if_done ─▶ DONE ─▶ index publish

A commit that cannot be true fails the transfer on both sides (DONE means the bytes arrived,
docs/design/security.md): positions outside the declared delta, a slot that is not this
transfer's, a DIRECT commit into pages the transport cannot write, a checksum that does not match.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from kvservice_client import Layout

from .. import kernels
from ..errors import Aborted, FailedPrecondition, InvalidArgument, KVServiceError, NotFound
from ..index import PrefixIndex
from ..kernels.streams import run_on_device
from ..staging import Slot, StagingPool
from . import trace
from .integrity import landed_check, unpack_verified
from .receiver import Incoming, Receiver
from .records import TransferTable
from .values import Commit

__all__ = ["Inbound"]

log = logging.getLogger(__name__)

Held = tuple[StagingPool, Slot]


class Inbound:
    """Applies commits to this service's declarations; every method runs on the event loop."""

    def __init__(
        self,
        table: TransferTable,
        receiver: Receiver,
        regions_of: Callable[[Incoming], kernels.KVRegions],
        no_direct: set[str],
        fail: Callable[[Incoming, KVServiceError], Awaitable[None]],
        index: PrefixIndex,
    ) -> None:
        self.table = table
        self.receiver = receiver
        self.regions_of = regions_of
        self.no_direct = no_direct  # buffer sets the transport could not register
        self.fail = fail
        self._index = index

    async def apply(
        self,
        transfer_id: str,
        dst_bs: str,
        sender_id: str,
        src_rank: int,
        ticket: str,
        identity: str,
        c: Commit,
        credits: dict[int, Held] | None = None,
        src_layout: Layout | None = None,
    ) -> str:
        """A peer's commit: only the sender rank that fetched this transfer's plan, as the same peer
        ``identity``, with its ticket, may commit; ``credits``: its channel's credit slots.
        ``src_layout``: the commit of an offered plan (the rank binds at its first)."""
        trace.mark(transfer_id, "commit_got")
        inc = self.receiver.get(transfer_id, dst_bs)
        key = f"{sender_id}/{src_rank}"
        if src_layout is not None:
            if src_layout.tp_rank != src_rank:
                raise InvalidArgument(
                    "src_layout", f"tp_rank {src_layout.tp_rank} is not src_tp_rank {src_rank}"
                )
            self.receiver.senders.bind_offered(inc, src_layout, key, sender_id, identity, ticket)
        self.receiver.senders.check_sender(inc, sender_id, identity, key, ticket)
        held = None
        if c.path == "PACKED" and c.positions.size and c.credit:
            held = (credits or {}).get(c.slot_id)
            if held is None:
                raise NotFound(f"staging_slot: {c.slot_id} is not a credit of this channel")
        return await self.accept(inc, key, c, held)

    def release(
        self,
        transfer_id: str,
        dst_bs: str,
        sender_id: str,
        identity: str,
        key: str,
        ticket: str,
        slot_id: int,
    ) -> str:
        """A sender gives back a reserved slot it will not commit."""
        inc = self.receiver.get(transfer_id, dst_bs)
        self.receiver.senders.check_sender(inc, sender_id, identity, key, ticket)
        held = inc.slots.pop(slot_id, None)
        if held is not None:
            held[0].release(held[1])
        return inc.rec.state

    async def accept(self, inc: Incoming, sender: str, c: Commit, held: Held | None = None) -> str:
        """Land (unpack a PACKED batch from ``held`` or its reserved slot; verify a DIRECT or
        FUSED one) and account the commit of sender rank ``sender``; returns the receiver's state."""
        if c.path == "PACKED" and c.positions.size:
            release = held is None
            if held is None:
                held = inc.slots.pop(c.slot_id, None)
                if held is None:
                    raise NotFound(f"staging_slot: {c.slot_id} is not reserved for this transfer")
            await self._guarded(self._unpack(inc, sender, held, c, release), inc)
        elif c.positions.size and (inc.integrity or c.path == "DIRECT"):
            await self._guarded(self._check_landed(inc, sender, c), inc)
        return await self.account(inc, sender, c)

    async def _guarded(self, work: Awaitable[None], inc: Incoming) -> None:
        try:
            await work
        except (Aborted, NotFound):
            raise
        except KVServiceError as exc:  # a bad unpack or a false commit fails the transfer on both sides
            await self.fail(inc, exc)
            raise

    async def _unpack(self, inc: Incoming, sender: str, held: Held, c: Commit, release: bool) -> None:
        pool, slot = held
        try:
            regions = self.regions_of(inc)
            units = inc.units.get(sender)
            if units is None:
                raise FailedPrecondition(f"sender {sender} committed without fetching the plan")
            dst = units.land(c.positions, inc.prefix_pages, inc.dst_pages)
            nbytes = kernels.packed_nbytes(regions, int(dst.size), c.num_heads, unit=units.tokens)
            inc.enter()
            t0 = time.monotonic()
            trace.mark(inc.rec.transfer_id, "unpack_start")
            try:
                if inc.rec.terminal:
                    raise Aborted(f"transfer {inc.rec.transfer_id!r} is {inc.rec.state}: {inc.rec.error}")
                view = pool.view(slot)
                if nbytes > view.numel():  # NOTE: DONE means bytes arrived: no slot, no data
                    raise FailedPrecondition(
                        f"positions: {c.positions.size} positions need {nbytes} bytes; staging slot "
                        f"{slot.serial} holds {view.numel()}"
                    )
                view = view[:nbytes]
                kw: dict[str, Any] = {
                    "head_start": c.head_start,
                    "num_heads": c.num_heads,
                    "unit": units.tokens,
                }
                if inc.integrity:  # verified before a byte is unpacked: the unpack is gated on the verdict
                    what = f"packed batch at position {int(c.positions[0])}"
                    await unpack_verified(regions, view, dst, c.check, what, **kw)
                else:
                    await run_on_device(
                        view.device, "unpack", lambda: kernels.unpack(regions, view, dst, **kw)
                    )
            finally:
                inc.leave()
        finally:
            if release:
                pool.release(slot)
        t1 = time.monotonic()
        trace.mark(inc.rec.transfer_id, "unpacked")
        self.table.update(inc.rec, add_unpack=int((t1 - t0) * 1e6))
        if log.isEnabledFor(logging.DEBUG):  # the receiver's half of a batch timeline (monotonic s)
            log.debug(
                "unpacked batch",
                extra={"transfer_id": inc.rec.transfer_id, "first": int(c.positions[0]), "t": [t0, t1]},
            )

    async def _check_landed(self, inc: Incoming, sender: str, c: Commit) -> None:
        """DONE means the bytes arrived (docs/design/security.md): a DIRECT commit into pages the
        transport could not have written fails the transfer; with integrity, the pages a DIRECT or
        FUSED commit names must hash to the sender's checksum (packed for this rank, as a staging
        batch)."""
        if c.path == "DIRECT" and inc.bs.buffer_set_id in self.no_direct:
            raise FailedPrecondition(
                f"path: a DIRECT commit of {c.positions.size} positions, but this buffer set takes no "
                "direct writes: no data reached them"
            )
        if not inc.integrity:
            return
        units = inc.units.get(sender)
        if units is None:
            raise FailedPrecondition(f"sender {sender} committed without fetching the plan")
        dst = units.land(c.positions, inc.prefix_pages, inc.dst_pages)
        await landed_check(
            self.regions_of(inc),
            dst,
            c.check,
            f"{c.path.lower()} chunk at position {int(c.positions[0])}",
            head_start=c.head_start,
            num_heads=c.num_heads,
            unit=units.tokens,
        )

    async def account(self, inc: Incoming, sender: str, c: Commit) -> str:
        """Account a commit whose bytes are in ``inc``'s pages; DONE (and publish) when it was the
        last. A malformed commit fails the transfer (and raises); returns the receiver's state."""
        try:
            self.table.update(
                inc.rec,
                add_pack=c.pack_us,
                add_wire=c.wire_us,
                add_descriptors=c.descriptors,
                **({"path": c.path} if c.positions.size else {}),
            )
            self.receiver.record_chunk(
                inc, sender, c.positions, c.last, c.nbytes, c.skipped, c.aux, c.primary
            )
            lost = inc.bs.lost()  # the engine shrank its memory while this commit's bytes landed
            if lost:
                raise FailedPrecondition(lost)
        except (Aborted, NotFound):
            raise
        except KVServiceError as exc:
            await self.fail(inc, exc)
            raise
        if self.receiver.complete_if_done(inc):
            self.publish(inc)
        return inc.rec.state

    def publish(self, inc: Incoming) -> None:
        """After DONE: insert the sequence's pages into the index when the receiver asked to."""
        if inc.publish_hashes is None:
            return
        pages = np.concatenate([inc.prefix_page_indices, inc.dst_pages])
        try:
            self._index.publish(inc.bs.buffer_set_id, inc.publish_hashes, pages, 0, tokens=inc.publish_tokens)
        except Exception:
            log.exception("publishing received pages failed", extra={"transfer_id": inc.rec.transfer_id})
