"""KVService servicer: protobuf in, domain call, protobuf out. No business logic here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from kvservice_client._proto import kvservice_pb2 as pb
from kvservice_client._proto import kvservice_pb2_grpc

from ..node import VERSION, Node
from . import convert
from .errors import grpc_errors

__all__ = ["KVServiceServicer"]

Ctx = grpc.aio.ServicerContext


class KVServiceServicer(kvservice_pb2_grpc.KVServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    def _session(self, context: Ctx) -> str:
        return self.node.sessions.require(convert.session_of(context)).session_id

    @grpc_errors
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Ctx) -> AsyncIterator[pb.SessionEvent]:
        session = self.node.open_session(request.client_name)
        try:
            yield pb.SessionEvent(session_id=session.session_id)
            await asyncio.Event().wait()  # held until the client goes (cancellation)
        finally:
            self.node.close_session(session.session_id)

    @grpc_errors
    async def RegisterBuffers(self, request: pb.RegisterBuffersRequest, context: Ctx) -> pb.RegisterBuffersResponse:
        session = self._session(context)
        bs = await asyncio.to_thread(
            self.node.register_buffers,
            session,
            request.engine_id,
            convert.layout(request.layout),
            request.k_regions,
            request.v_regions,
            request.aux_regions,
        )
        return pb.RegisterBuffersResponse(
            buffer_set_id=bs.buffer_set_id, page_bytes_k=bs.layout.page_bytes_k, page_bytes_v=bs.layout.page_bytes_v
        )

    @grpc_errors
    async def UnregisterBuffers(
        self, request: pb.UnregisterBuffersRequest, context: Ctx
    ) -> pb.UnregisterBuffersResponse:
        result = self.node.unregister_buffers(self._session(context), request.buffer_set_id)
        return pb.UnregisterBuffersResponse(
            transfers_aborted=result.transfers_aborted, index_entries_dropped=result.index_entries_dropped
        )

    @grpc_errors
    async def MatchPrefix(self, request: pb.MatchPrefixRequest, context: Ctx) -> pb.MatchPrefixResponse:
        self.node.require_index("MatchPrefix")
        return pb.MatchPrefixResponse()

    @grpc_errors
    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: Ctx) -> pb.ReleaseLeaseResponse:
        self.node.require_index("ReleaseLease")
        return pb.ReleaseLeaseResponse()

    @grpc_errors
    async def PublishPages(self, request: pb.PublishPagesRequest, context: Ctx) -> pb.PublishPagesResponse:
        self.node.require_index("PublishPages")
        return pb.PublishPagesResponse()

    @grpc_errors
    async def EvictPages(self, request: pb.EvictPagesRequest, context: Ctx) -> pb.EvictPagesResponse:
        self.node.require_index("EvictPages")
        return pb.EvictPagesResponse()

    @grpc_errors
    async def ExpectDelta(self, request: pb.ExpectDeltaRequest, context: Ctx) -> pb.ExpectDeltaResponse:
        self.node.require_transfers("ExpectDelta")
        return pb.ExpectDeltaResponse()

    @grpc_errors
    async def SendDelta(self, request: pb.SendDeltaRequest, context: Ctx) -> pb.SendDeltaResponse:
        self.node.require_transfers("SendDelta")
        return pb.SendDeltaResponse()

    @grpc_errors
    async def Poll(self, request: pb.PollRequest, context: Ctx) -> pb.PollResponse:
        self.node.require_transfers("Poll")
        return pb.PollResponse()

    @grpc_errors
    async def WatchTransfers(
        self, request: pb.WatchTransfersRequest, context: Ctx
    ) -> AsyncIterator[pb.TransferStatus]:
        self.node.require_transfers("WatchTransfers")
        if False:  # pragma: no cover - makes this an async generator
            yield pb.TransferStatus()

    @grpc_errors
    async def Abort(self, request: pb.AbortRequest, context: Ctx) -> pb.AbortResponse:
        self.node.require_transfers("Abort")
        return pb.AbortResponse()

    @grpc_errors
    async def GetStats(self, request: pb.GetStatsRequest, context: Ctx) -> pb.GetStatsResponse:
        node = self.node
        resp = pb.GetStatsResponse(
            service_id=node.service_id, version=VERSION, uptime_ms=node.uptime_ms, sessions=len(node.sessions)
        )
        for bs in node.buffers.all():
            resp.buffer_sets.append(convert.buffer_set_info(bs, 0))
        return resp
