"""The receiver port of another service: its plans, staging and commits over the peer channel.

targets    the plans the receiver pushed at ExpectDelta (the channel's offers), else
           GetReceivePlan on the channel (unary for a peer without one) ─▶ port.Plan each rank;
           same host: the receiver's pools opened here (peer_pools) for fused copies
reserve    a channel credit (returned with the commit's ack), else ReserveStaging
write_aux  one WRITE of the aux rows
commit     CommitChunk on the channel (the ack is the receiver's answer), else unary
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import numpy as np
from kvservice_client.proto import peer_pb2

from .. import host
from ..errors import DeadlineExceeded, FailedPrecondition, NotFound
from ..kernels import KVRegions
from . import trace
from .aux_rows import aux_rows
from .descriptors import prepped_rows
from .peer_channel import OutboundChannel
from .peer_codec import commit_to_pb, plan_from_pb
from .peer_pools import PeerPools
from .peers import PeerClient, error_from_code
from .receiver import check_compatible, routes_for
from .sender import Chunk, Outgoing
from .transport import MemKind, RemoteDescList, Transport
from .values import Commit, Plan, Reserved, Target
from .writes import post_write, wait_write

__all__ = ["PeerReceiver"]

log = logging.getLogger(__name__)


def _left(out: Outgoing) -> float:
    left = out.rec.deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("transfer deadline passed")
    return left


def credit_key(plan: Plan) -> tuple[str, int]:
    """The receiver staging pool a plan's pages land through: (mem kind, device)."""
    r = plan.kv_regions[0]
    return (r.mem_kind or "DRAM", r.device if r.mem_kind == "VRAM" else 0)


class PeerReceiver:
    verifies_copies = True  # the bytes crossed into another service

    def __init__(
        self,
        peer: PeerClient,
        me: tuple[str, str],
        transport: Transport,
        peer_pools: PeerPools,
        same_host_auto: bool,
        note: Callable[[Outgoing, str, str], None],
        on_lane_slot: Callable[[str, PeerClient, peer_pb2.ReceivePlan], None] | None = None,
    ) -> None:
        self.peer = peer
        self._on_lane_slot = on_lane_slot  # (address, peer, ReceivePlan) -> None: the cross-node lane
        self._me = me  # (service id, address) of this sending service
        self.transport = transport
        self._pools = peer_pools
        self._same_host_auto = same_host_auto
        self._note = note  # (out, why) -> None: records and logs a same-host refusal
        self._remote_lists: dict[tuple[str, str, int], RemoteDescList] = {}  # prepped once per rank × epoch
        self.opened: OutboundChannel | None = None  # the channel, once a handshake said the peer has one

    @property
    def channel(self) -> OutboundChannel | None:
        """The persistent channel to the receiving service (None: a peer without one). Made at
        first use after a handshake: a port made before one (an early abort) gets it later."""
        if self.opened is None and "channel" in self.peer.capabilities:
            lane = self._on_lane_slot
            on_plan = None if lane is None else (lambda m: lane(self.peer.address, self.peer, m))
            self.opened = OutboundChannel(self.peer.address, lambda: self.peer.stub, self._me, on_plan)
        return self.opened

    # -- plans -----------------------------------------------------------------------------------
    async def targets(self, out: Outgoing) -> list[Target]:
        peer = self.peer
        offered = await self._offered(out)
        if offered is not None:
            return offered
        same_host = self._same_host(peer)
        req = peer_pb2.GetReceivePlanRequest(
            transfer_id=out.rec.transfer_id,
            sender_service_id=self._me[0],
            src_layout=out.bs.layout.to_proto(),
            wait_ms=int(_left(out) * 1000),
            sender_address=self._me[1],
            sender_boot_id=host.boot_id() if same_host else "",
        )
        trace.mark(out.rec.transfer_id, "plan_asked")
        try:
            if self.channel is not None:  # one message each way on the open channel
                resp = await self.channel.plans(req, _left(out) + 1.0)
            else:
                resp = await peer.call("GetReceivePlan", req, _left(out) + 1.0)
            trace.mark(out.rec.transfer_id, "plan_got")
        except NotFound as exc:
            if time.monotonic() >= out.rec.deadline - 0.05:  # the wait was bounded by our deadline
                raise DeadlineExceeded(f"transfer deadline passed: {exc.message}") from None
            raise
        out.tickets.update(m.sender_ticket for m in resp.plans)
        await peer.refresh(min_epoch=resp.metadata_epoch, service_id=resp.service_id, timeout=_left(out))
        plans = [plan_from_pb(m, out.bs.layout.tp_rank) for m in resp.plans]
        return [Target.of(p, out.bs.layout, self._open(out, p) if same_host else None) for p in plans]

    async def _offered(self, out: Outgoing) -> list[Target] | None:
        """``offered_now`` once the receiver's metadata here is as new as its offer's."""
        hit = self.opened.offers.get(out.rec.transfer_id) if self.opened is not None else None
        if hit is None:
            return None
        await self.peer.refresh(min_epoch=hit.metadata_epoch, service_id=hit.service_id, timeout=_left(out))
        return self.offered_now(out)

    def offered_now(self, out: Outgoing) -> list[Target] | None:
        """Targets from the plans the receiver pushed at ExpectDelta, without a single await (no
        task, no loop hop), or None, and the sender asks: no offer, the receiver's metadata here
        older than the offer's, not every receiver rank we route to offered, this rank took it
        already, or layouts that do not fit (the ask then makes the receiver fail it, as it
        would have). On the same host the offered plan carries the pools' handles (or why not),
        as an asked one does: the fused route, or the transport with the reason noted."""
        peer, src, tid = self.peer, out.bs.layout, out.rec.transfer_id
        if self.opened is None or not peer.agent:
            return None
        hit = self.opened.offers.get(tid)
        if hit is None or not peer.knows(hit.metadata_epoch, hit.service_id) or src.tp_rank in hit.used_by:
            return None
        dst = next(iter(hit.plans.values())).dst_layout
        wanted = routes_for(src, dst.tp_size)
        if any(r.dst_rank not in hit.plans for r in wanted):
            return None
        try:
            check_compatible(src, dst)
        except FailedPrecondition:
            return None
        plans = [dataclasses.replace(hit.plans[r.dst_rank], route=r, offered=True) for r in wanted]
        same_host = self._same_host(peer)
        hit.used_by.add(src.tp_rank)
        out.tickets.update(p.sender_ticket for p in plans)
        trace.mark(tid, "plan_offered")
        return [Target.of(p, src, self._open(out, p) if same_host else None) for p in plans]

    def _same_host(self, peer: PeerClient) -> bool:
        return self._same_host_auto and bool(peer.boot_id) and peer.boot_id == host.boot_id()

    def drop_offer(self, transfer_id: str, ticket: str) -> bool:
        """The receiver ended ``transfer_id`` before we used its offer: forget it."""
        return self.opened is not None and self.opened.offers.drop(transfer_id, ticket)

    def _open(self, out: Outgoing, plan: Plan) -> KVRegions | None:
        """The receiver rank's pools mapped here, or None with the reason noted."""
        why = plan.same_host_refusal
        if not why and not plan.kv_handles:
            why = "the receiver sent no pool handles (an older service?)"
        if not why:
            try:
                return self._pools.open(self.peer.service_id, plan)
            except FailedPrecondition as exc:
                why = exc.message
        self._note(out, self.peer.service_id, why)
        return None

    @contextlib.asynccontextmanager
    async def writing(self, out: Outgoing, target: Target) -> AsyncIterator[None]:
        yield  # the receiving service's abort reaches us as a peer abort; we settle, then answer

    # -- staging ---------------------------------------------------------------------------------
    async def batch_pages(self, out: Outgoing, target: Target, per_page: int, pages: int) -> int:
        if self.channel is None:
            return pages
        credit_bytes = await self.channel.slot_size(credit_key(target.plan), out.rec.deadline)
        if credit_bytes < per_page:  # a page does not fit the receiver's credits: reserve per batch
            return pages
        return min(pages, credit_bytes // per_page)

    async def reserve(self, out: Outgoing, target: Target, nbytes: int) -> Reserved:
        plan, chan = target.plan, self.channel
        key = credit_key(plan)
        if chan is not None and await chan.slot_size(key, out.rec.deadline) >= nbytes:
            credit, epoch = await chan.acquire(*key, out.rec.deadline)
            return Reserved(
                credit.slot_id,
                credit.address,
                credit.device_id,
                credit.mem_kind or "DRAM",
                credit=(key, credit, epoch),
            )
        resp = await self.peer.call(
            "ReserveStaging",
            peer_pb2.ReserveStagingRequest(
                transfer_id=out.rec.transfer_id,
                dst_buffer_set_id=plan.dst_buffer_set_id,
                nbytes=nbytes,
                sender_ticket=plan.sender_ticket,
            ),
            _left(out) + 1.0,
        )
        return Reserved(resp.slot_id, resp.address, resp.device_id, resp.mem_kind or "DRAM")

    async def unreserve(self, out: Outgoing, target: Target, slot: Reserved) -> None:
        if slot.credit is not None:
            assert self.channel is not None
            self.channel.give_back(*slot.credit)
            return
        try:
            await self.peer.call(
                "CommitChunk",
                peer_pb2.CommitChunkRequest(
                    transfer_id=out.rec.transfer_id,
                    dst_buffer_set_id=target.plan.dst_buffer_set_id,
                    sender_service_id=self._me[0],
                    src_tp_rank=out.bs.layout.tp_rank,
                    staging_slot=slot.slot_id,
                    release_only=True,
                    sender_ticket=target.plan.sender_ticket,
                ),
                2.0,
            )
        except Exception:  # the receiver frees the slot with the transfer anyway
            pass

    # -- bytes and commits -----------------------------------------------------------------------
    async def write(
        self, out: Outgoing, local: np.ndarray, remote: np.ndarray, local_kind: str, remote_kind: str
    ) -> None:
        h = await post_write(self.transport, self.peer.agent, local, remote, None, local_kind, remote_kind)
        await wait_write(self.transport, out, h)

    async def remote_pages(self, plan: Plan) -> RemoteDescList:
        key = (self.peer.service_id, plan.dst_buffer_set_id, self.peer.epoch)
        hit = self._remote_lists.get(key)
        if hit is None:
            r0 = plan.kv_regions[0]
            rows = prepped_rows(
                np.array([r.address for r in plan.kv_regions], dtype=np.int64),
                np.array([r.size // plan.dst_layout.num_pages for r in plan.kv_regions], dtype=np.int64),
                plan.dst_layout.num_pages,
                r0.device,
            )
            kind: MemKind = "VRAM" if r0.mem_kind == "VRAM" else "DRAM"
            hit = await asyncio.to_thread(self.transport.prep_remote, self.peer.agent, rows, kind)
            self._remote_lists[key] = hit
        return hit

    async def write_aux(self, out: Outgoing, target: Target, chunk: Chunk) -> tuple[int, int]:
        local, remote = aux_rows(out.bs, target.plan, chunk.aux)
        if not local.size:
            return 0, 0
        await self.write(out, local, remote, "DRAM", "DRAM")
        return int(local[:, 1].sum()), len(local)

    async def commit(
        self, out: Outgoing, target: Target, seq: int, commit: Commit, slot: Reserved | None = None
    ) -> None:
        req = commit_to_pb(commit, out.rec.transfer_id, target.plan, self._me[0], out.bs.layout, seq)
        trace.mark(out.rec.transfer_id, "commit_sent")
        if self.channel is None:
            await self.peer.call("CommitChunk", req, _left(out) + 1.0)
            return
        credit = slot.credit if slot is not None else None  # comes back with the ack
        ack = await self.channel.commit(req, _left(out) + 1.0, credit)
        trace.mark(out.rec.transfer_id, "ack_got")
        if ack.error_code:
            raise error_from_code(ack.error_code, f"peer {out.peer_address}: {ack.error}")

    async def tell_abort(self, out: Outgoing, code: str, reason: str) -> None:
        """One abort per receiver rank, each with the ticket its plan gave us (docs/design/security.md)."""
        for ticket in sorted({t.plan.sender_ticket for t in out.targets or ()}) or [""]:
            try:
                await self.peer.call(
                    "Abort",
                    peer_pb2.PeerAbortRequest(
                        transfer_id=out.rec.transfer_id,
                        reason=reason,
                        origin_service_id=self._me[0],
                        error_code=code,
                        sender_ticket=ticket,
                    ),
                    2.0,
                )
            except Exception as exc:
                log.warning(
                    "could not tell receiver about abort: %s", exc, extra={"transfer_id": out.rec.transfer_id}
                )

    async def close(self) -> None:
        if self.opened is not None:
            await self.opened.close()
