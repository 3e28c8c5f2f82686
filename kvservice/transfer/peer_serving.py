"""This service answering a sending service (KVPeer unary calls and the peer channel): protobuf in,
domain calls (Receiver, Inbound), protobuf out.

    ExpectDelta    ─▶ offer_plan: pushed on the named sender's open channel, before it asks
                      (it binds its rank at its first commit, SenderBinding.bind_offered)
    GetReceivePlan ─▶ Receiver.plans (wait for the declarations, bind the sender) ─▶ plans + tickets
                      (+ the pools' handles for a same-host sender on a local connection)
    ReserveStaging ─▶ Receiver.reserve ─▶ a staging slot
    CommitChunk    ─▶ Inbound.apply (checks the sender) ─▶ unpack / verify, account, DONE
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from kvservice_client import Layout
from kvservice_client.proto import peer_pb2

from .. import host
from ..errors import FailedPrecondition
from ..identity import LOCAL_PEER
from ..kernels.heads import HeadRoute
from . import trace
from .peer_codec import commit_from_pb, plan_to_pb
from .receiver import Incoming, plan_of

if TYPE_CHECKING:
    from .engine import TransferEngine
    from .inbound import Held
    from .peer_channel import InboundChannel
    from .peers import PeerDirectory

__all__ = ["apply_commit", "offer_plan", "receive_plans", "reserve_staging", "tell_sender"]

log = logging.getLogger(__name__)


async def receive_plans(
    engine: TransferEngine, request: peer_pb2.GetReceivePlanRequest, peer: str, identity: str
) -> peer_pb2.ReceivePlanSet:
    """GetReceivePlan (``peer``: the caller's gRPC peer string, ``identity``: what it proved, see
    kvservice.identity): wait for the declarations this sender rank writes to, then say where its
    pages go — with the receiver's pool handles for a same-host sender on a local connection."""
    src = Layout.from_proto(request.src_layout)
    wait = min(request.wait_ms / 1000, engine.config.transfer.max_deadline_ms / 1000)
    await engine.lane.gate(request.transfer_id, src)  # a peer sends it: the native lane may not
    found = await engine.receiver.plans(
        request.transfer_id, src, request.sender_service_id, request.sender_address, wait, identity
    )
    await engine.lane.gate(request.transfer_id, src)
    out = peer_pb2.ReceivePlanSet(metadata_epoch=engine.metadata_epoch, service_id=engine.service_id)
    same_host = bool(request.sender_boot_id) and request.sender_boot_id == host.boot_id()
    refusal = (
        "" if host.is_local_peer(peer) else f"the plan was asked over {peer}, not a Unix socket or loopback"
    )
    key = f"{request.sender_service_id}/{src.tp_rank}"
    for inc, _ in found:  # asked: those ranks' cross-node lane slots go (their sender uses gRPC)
        engine.lane.gate_in(request.transfer_id, inc.bs.buffer_set_id)
    for inc, route in found:
        plan = plan_to_pb(plan_of(inc, route, inc.bs.buffer_set_id not in engine.no_direct, key))
        if same_host:
            _same_host_pools(engine, inc, plan, refusal)
        out.plans.append(plan)
    trace.mark(request.transfer_id, "plan_served")
    return out


async def offer_plan(engine: TransferEngine, inc: Incoming, chan: InboundChannel) -> bool:
    """Push ``inc``'s plan to the sending service on its open channel ``chan`` before any of
    its ranks asks (ExpectDelta named it): the ask's round trip leaves the transfer's path.
    False: nothing offered (that service may not send it, or this node's lane moves it).

    A channel over a Unix socket (identity ``local``) comes from a service on this host: with
    ``same_host_route=auto`` its plan carries the pools' handles, as an asked plan would, so the
    same-host fused route needs no ask either."""
    try:
        await engine.lane.gate(inc.rec.transfer_id)  # a peer sends it: the native lane may not
    except FailedPrecondition:
        return False
    offer = engine.receiver.senders.offer(inc, chan.peer, chan.address, chan.identity)
    if offer is None:
        return False
    route = HeadRoute(0, inc.bs.layout.tp_rank, 0, 0, 0)  # each sender rank derives its own
    plan = plan_of(inc, route, inc.bs.buffer_set_id not in engine.no_direct)
    pb = plan_to_pb(dataclasses.replace(plan, sender_ticket=offer.ticket))
    if chan.identity == LOCAL_PEER:
        _same_host_pools(engine, inc, pb, "")
    engine.lane.offer_slot(inc, chan.peer, chan.identity, offer.ticket, pb)  # the cross-node lane's
    offer_set = peer_pb2.ReceivePlanSet(
        plans=[pb], metadata_epoch=engine.metadata_epoch, service_id=engine.service_id
    )
    await chan.offer(offer_set)
    trace.mark(inc.rec.transfer_id, "plan_offered")
    return True


def _same_host_pools(engine: TransferEngine, inc: Incoming, plan: peer_pb2.ReceivePlan, refusal: str) -> None:
    """A plan for a sender on this host: the receiver's pool handles (the fused route), or why not
    (``refusal``: the connection's reason, if any)."""
    if engine.config.transfer.same_host_route != "auto":
        refusal = "the receiver's same_host_route is 'off'"
    why = refusal or ("the receiver lands it in its landing pool" if inc.landing else "")
    if not why:
        plan.kv_handles.extend(r.origin for r in (*inc.bs.k, *inc.bs.v))
    plan.same_host_refusal = why


async def reserve_staging(
    engine: TransferEngine, request: peer_pb2.ReserveStagingRequest, identity: str
) -> peer_pb2.StagingSlot:
    engine.lane.gate_in(request.transfer_id, request.dst_buffer_set_id)  # the sender took gRPC
    pool, slot = await engine.receiver.reserve(
        request.transfer_id, request.dst_buffer_set_id, request.nbytes, identity, request.sender_ticket
    )
    return peer_pb2.StagingSlot(
        slot_id=slot.serial,
        address=slot.addr,
        size_bytes=slot.nbytes,
        mem_kind="VRAM" if pool.kind == "vram" else "DRAM",
        device_id=pool.device,
    )


async def apply_commit(
    engine: TransferEngine,
    req: peer_pb2.CommitChunkRequest,
    identity: str,
    credits: dict[int, Held] | None = None,
) -> str:
    """A sender's CommitChunk (unary, or on its channel with the channel's ``credits``)."""
    engine.lane.gate_in(req.transfer_id, req.dst_buffer_set_id)  # the sender took gRPC: not the lane
    if req.release_only:
        key = f"{req.sender_service_id}/{req.src_tp_rank}"
        return engine.inbound.release(  # type: ignore[no-any-return]
            req.transfer_id,
            req.dst_buffer_set_id,
            req.sender_service_id,
            identity,
            key,
            req.sender_ticket,
            req.staging_slot,
        )
    return await engine.inbound.apply(
        req.transfer_id,
        req.dst_buffer_set_id,
        req.sender_service_id,
        req.src_tp_rank,
        req.sender_ticket,
        identity,
        commit_from_pb(req),
        credits,
        Layout.from_proto(req.src_layout) if req.HasField("src_layout") else None,
    )


async def tell_sender(
    peers: PeerDirectory, me: str, address: str, transfer_id: str, code: str, reason: str, ticket: str = ""
) -> None:
    """Best effort: tell the sending service at ``address`` that the receiver ``me`` stopped
    ``transfer_id`` (it settles its in-flight writes before it answers)."""
    try:
        await peers.get(address).call(
            "Abort",
            peer_pb2.PeerAbortRequest(
                transfer_id=transfer_id,
                reason=reason,
                origin_service_id=me,
                error_code=code,
                sender_ticket=ticket,
            ),
            5.0,
        )
    except Exception as exc:
        log.warning(
            "abort not acknowledged by sender %s: %s", address, exc, extra={"transfer_id": transfer_id}
        )
