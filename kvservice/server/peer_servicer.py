"""KVPeer servicer: the service-to-service control plane (thin; logic in transfer/)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc
import numpy as np
from kvservice_client.proto import peer_pb2, peer_pb2_grpc

from .. import host
from ..identity import peer_identity
from ..node import VERSION, Node
from ..transfer.peer_channel import serve_channel
from ..transfer.peer_serving import apply_commit, receive_plans, reserve_staging
from ..transfer.peers import CAPABILITIES
from .convert import STATE_PB
from .errors import grpc_errors

__all__ = ["KVPeerServicer"]

Ctx: TypeAlias = grpc.aio.ServicerContext


class KVPeerServicer(peer_pb2_grpc.KVPeerServicer):
    def __init__(self, node: Node) -> None:
        self.node = node
        self.engine = node.transfers

    @grpc_errors
    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: Ctx) -> peer_pb2.HandshakeResponse:
        e = self.engine
        await e.peers.me.lane_settled()  # our lane's metadata in the answer; theirs loaded into it
        if request.service_id != e.service_id:  # its cross-node lane writes here and we ack to it
            e.lane.load_peer(request.service_id, bytes(request.lane_agent_metadata))
        return peer_pb2.HandshakeResponse(
            service_id=e.service_id,
            version=VERSION,
            transport=e.transport.kind,
            agent_name=e.transport.agent_name,
            agent_metadata=e.transport.metadata(),
            capabilities=list(CAPABILITIES),
            metadata_epoch=e.metadata_epoch,
            boot_id=host.boot_id(),
            hostname=host.hostname(),
            lane_agent_metadata=e.lane.metadata(),
        )

    @grpc_errors
    async def GetReceivePlan(
        self, request: peer_pb2.GetReceivePlanRequest, context: Ctx
    ) -> peer_pb2.ReceivePlanSet:
        return await receive_plans(self.engine, request, context.peer(), peer_identity(context))

    @grpc_errors
    async def ReserveStaging(
        self, request: peer_pb2.ReserveStagingRequest, context: Ctx
    ) -> peer_pb2.StagingSlot:
        return await reserve_staging(self.engine, request, peer_identity(context))

    @grpc_errors
    async def CommitChunk(
        self, request: peer_pb2.CommitChunkRequest, context: Ctx
    ) -> peer_pb2.CommitChunkResponse:
        state = await apply_commit(self.engine, request, peer_identity(context))
        return peer_pb2.CommitChunkResponse(state=STATE_PB[state])

    async def Channel(self, request_iterator: AsyncIterator[peer_pb2.ChannelMessage], context: Ctx) -> None:
        """The peer channel of one sending service (transfer/peer_channel.py)."""
        await serve_channel(request_iterator, context, self.engine)

    @grpc_errors
    async def HeldPages(self, request: peer_pb2.HeldPagesRequest, context: Ctx) -> peer_pb2.HeldPagesResponse:
        held = self.node.index.held(request.buffer_set_id, np.asarray(request.hashes, dtype=np.uint64))
        return peer_pb2.HeldPagesResponse(held=held.tolist(), service_id=self.node.service_id)

    @grpc_errors
    async def Abort(self, request: peer_pb2.PeerAbortRequest, context: Ctx) -> peer_pb2.PeerAbortResponse:
        known = await self.engine.abort_from_peer(
            request.transfer_id,
            request.error_code or "ABORTED",
            f"peer {request.origin_service_id}: {request.reason}",
            request.origin_service_id,
            peer_identity(context),
            request.sender_ticket,
        )
        return peer_pb2.PeerAbortResponse(known=known)
