"""KVService servicer: protobuf in, domain call, protobuf out. No business logic here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from kvservice_client import lane_wire
from kvservice_client.contract import BEARER_METADATA_KEY
from kvservice_client.proto import kvservice_pb2 as pb
from kvservice_client.proto import kvservice_pb2_grpc

from ..errors import DeadlineExceeded, InvalidArgument, KVServiceError, ResourceExhausted, Unavailable
from ..identity import certificate_identity
from ..node import Node
from ..ops import AdminPolicy, PeerRtts, RecentTransfers
from ..sessions import Session
from ..transfer import trace
from ..transfer.landing import claim
from ..transfer.requests import build_chunk, build_incoming
from . import convert
from .credentials import CREDENTIAL_METADATA_KEY
from .errors import grpc_errors
from .limits import CallLimits
from .replay import ReplayCache, replayable
from .stats import stats_response
from .transfer_stream import TransferStream

__all__ = ["KVServiceServicer"]

Ctx: TypeAlias = grpc.aio.ServicerContext

RETRYABLE = (ResourceExhausted, Unavailable, DeadlineExceeded)  # refusals an engine may try again


class KVServiceServicer(kvservice_pb2_grpc.KVServiceServicer):
    def __init__(
        self,
        node: Node,
        activity: RecentTransfers | None = None,
        limits: CallLimits | None = None,
        peer_address: str = "",
    ) -> None:
        self.node = node
        self.replay = ReplayCache()
        # NOTE: the Guard checks unary requests against these; the Transfers stream, each call
        self.limits = limits
        self.admins = AdminPolicy(node.config, node.credentials)
        self.activity = activity or RecentTransfers()  # build_server feeds it the finished transfers
        self.rtts = PeerRtts()
        self.peer_address = peer_address  # told in each session's first event (Listeners.announced_address)

    def _session(self, context: Ctx) -> str:
        return self.node.sessions.require(convert.session_of(context)).session_id

    def _session_obj(self, context: Ctx) -> Session:
        return self.node.sessions.require(convert.session_of(context))

    @grpc_errors
    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: Ctx
    ) -> AsyncIterator[pb.SessionEvent]:
        credential = convert.metadata_value(context, CREDENTIAL_METADATA_KEY) or ""
        session, epoch = self.node.open_session(
            request.client_name,
            request.resume_session_id,
            credential,
            local=context.peer().startswith("unix"),
        )
        try:
            yield pb.SessionEvent(
                session_id=session.session_id,
                grace_ms=int(self.node.config.listen.session_grace_s * 1000),
                resumed=bool(request.resume_session_id),
                peer_address=self.peer_address,
            )
            notices = self.node.notices.of(session.session_id)
            while True:  # held until the stream ends (cancellation); carries notices meanwhile
                bs_id, count = await notices.get()
                yield pb.SessionEvent(
                    session_id=session.session_id,
                    duplicates=pb.DuplicateNotice(buffer_set_id=bs_id, duplicated_pages=count),
                )
        finally:
            self.node.session_stream_ended(session.session_id, epoch)

    @grpc_errors
    @replayable
    async def CloseSession(self, request: pb.CloseSessionRequest, context: Ctx) -> pb.CloseSessionResponse:
        session_id = self._session(context)
        owned = sum(b.session_id == session_id for b in self.node.buffers.all())
        await self.node.close_session(session_id)
        return pb.CloseSessionResponse(buffer_sets_released=owned)

    @grpc_errors
    @replayable
    async def RegisterBuffers(
        self, request: pb.RegisterBuffersRequest, context: Ctx
    ) -> pb.RegisterBuffersResponse:
        session = self._session_obj(context)
        bs = await asyncio.to_thread(
            self.node.register_buffers,
            session,
            request.engine_id,
            convert.layout(request.layout),
            request.k_regions,
            request.v_regions,
            request.aux_regions,
            request.inbound_max_transfers,
            request.inbound_max_bytes,
        )
        return pb.RegisterBuffersResponse(
            buffer_set_id=bs.buffer_set_id,
            page_bytes_k=bs.layout.page_bytes_k,
            page_bytes_v=bs.layout.page_bytes_v,
        )

    @grpc_errors
    @replayable
    async def UnregisterBuffers(
        self, request: pb.UnregisterBuffersRequest, context: Ctx
    ) -> pb.UnregisterBuffersResponse:
        result = await self.node.unregister_buffers(self._session(context), request.buffer_set_id)
        return pb.UnregisterBuffersResponse(
            transfers_aborted=result.transfers_aborted, index_entries_dropped=result.index_entries_dropped
        )

    @grpc_errors
    @replayable
    async def MatchPrefix(self, request: pb.MatchPrefixRequest, context: Ctx) -> pb.MatchPrefixResponse:
        node = self.node
        session = convert.session_of(context)
        if request.lease_ttl_ms:
            session = self._session(context)
        hashes = node.prefix.hashes(*convert.key(request, "tokens"), request.page_size, "key")
        matches, lease = node.prefix.match_prefix(
            session,
            hashes,
            request.page_size,
            list(request.buffer_set_ids),
            request.dp_rank if request.has_dp_rank else None,
            request.scores_only,
            request.lease_ttl_ms,
        )
        resp = pb.MatchPrefixResponse(query_pages=int(hashes.size))
        landing = node.transfers.landing
        tier_pages = node.tier.tier_pages(matches, hashes, touch=not request.scores_only)
        for m, in_tier in zip(matches, tier_pages, strict=True):
            landed = landing.match(hashes, m.buffer_set_id)
            resp.matches.append(convert.prefix_match(m, node.load_of(m.buffer_set_id), landed))
            resp.matches[-1].tier_pages = in_tier
        if lease is not None:
            node.tier.lease(lease, matches, hashes)
        elif request.lease_ttl_ms and any(tier_pages):
            lease = node.tier.lease_alone(session, request.lease_ttl_ms, matches, hashes)  # type: ignore[arg-type]
        if lease is not None:
            resp.lease_id, resp.lease_expires_unix_ms = lease.lease_id, lease.expires_unix_ms
        return resp

    @grpc_errors
    @replayable
    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: Ctx) -> pb.ReleaseLeaseResponse:
        self.node.tier.release_lease(request.lease_id, self._session(context))
        return pb.ReleaseLeaseResponse()

    @grpc_errors
    @replayable
    async def PublishPages(self, request: pb.PublishPagesRequest, context: Ctx) -> pb.PublishPagesResponse:
        tokens, hashes = convert.key(request, "tokens")
        n = self.node.prefix.publish_pages(
            self._session(context),
            request.buffer_set_id,
            tokens,
            hashes,
            np.asarray(request.page_indices, dtype=np.int64),
            request.priority,
        )
        return pb.PublishPagesResponse(inserted_pages=n)

    @grpc_errors
    @replayable
    async def EvictPages(self, request: pb.EvictPagesRequest, context: Ctx) -> pb.EvictPagesResponse:
        n = self.node.prefix.evict_pages(
            self._session(context),
            request.buffer_set_id,
            np.asarray(request.page_indices, dtype=np.int64),
            request.all,
        )
        return pb.EvictPagesResponse(evicted_pages=n)

    @grpc_errors
    @replayable
    async def OffloadPages(self, request: pb.OffloadPagesRequest, context: Ctx) -> pb.OffloadPagesResponse:
        done = await self.node.tier.offload_pages(
            self._session(context),
            request.buffer_set_id,
            np.asarray(request.page_indices, dtype=np.int64),
            np.asarray(request.hashes, dtype=np.uint64),
        )
        return pb.OffloadPagesResponse(
            stored_pages=done.stored, already_held=done.already_held, not_stored=done.not_stored
        )

    @grpc_errors
    @replayable
    async def LoadPages(self, request: pb.LoadPagesRequest, context: Ctx) -> pb.LoadPagesResponse:
        n = await self.node.tier.load_pages(
            self._session(context),
            request.buffer_set_id,
            np.asarray(request.page_indices, dtype=np.int64),
            np.asarray(request.hashes, dtype=np.uint64),
        )
        return pb.LoadPagesResponse(loaded_pages=n)

    # NOTE: the transfer calls' bodies (_expect, _send, _abort) serve the unary RPCs and the
    # Transfers stream alike.
    async def _expect(self, request: pb.ExpectDeltaRequest, session_id: str) -> pb.ExpectDeltaResponse:
        trace.mark(request.transfer_id, "expect_rpc")
        self.node.check_accepting("ExpectDelta")
        engine = self.node.transfers
        which = request.WhichOneof("publish")
        landing = request.landing if request.HasField("landing") else None
        try:
            inc = build_incoming(
                engine,
                session_id,
                transfer_id=request.transfer_id,
                buffer_set_id=request.buffer_set_id,
                prefix_pages=request.prefix_pages,
                dst_page_indices=request.dst_page_indices,
                aux=convert.aux_rows(request.aux),
                expected_senders=request.expected_senders,
                deadline_ms=request.deadline_ms,
                publish_tokens=convert.token_ids(request.publish_tokens, "publish_tokens")
                if which == "publish_tokens"
                else None,
                publish_hashes=np.asarray(request.publish_hashes.hashes, dtype=np.uint64)
                if which == "publish_hashes"
                else None,
                prefix_page_indices=request.prefix_page_indices,
                allowed_senders=request.allowed_senders,
                landing_pages=landing.pages if landing is not None else None,
                landing_aux=convert.landing_aux(landing.aux) if landing is not None else None,
            )
            if request.from_tier:
                await self.node.tier.source_from_tier(inc)
            if landing is not None:
                rec = await engine.landing.expect(inc, landing.ttl_ms, request.sender_address)
            else:
                rec = await engine.expect(inc, request.sender_address)
        except KVServiceError as exc:
            # a sender that came first (the engine posted its room beside the declaration)
            # learns why now, not at its deadline; NOTE: not for a landing (a refused one is
            # received directly: the allocation declares the id next) nor for a refusal the
            # engine may retry (a full pool, a busy service)
            if landing is None and not isinstance(exc, RETRYABLE):
                engine.receiver.refuse(request.transfer_id, request.sender_address, exc.message)
            raise
        return pb.ExpectDeltaResponse(status=convert.transfer_status(rec))

    async def lane_call(self, kind: int, session_id: str, request_id: str, body: bytes) -> bytes:
        """A CALL on an engine's lane (kvservice_client.lane_wire): ExpectDelta as the Transfers
        stream runs it (the per-call caps, the replay cache by request id), from the session the
        lane connection proved; the serialized response."""
        if kind != lane_wire.CALL_EXPECT:
            raise InvalidArgument("kind", f"{kind} is not a lane call (1: ExpectDelta)")
        self.node.sessions.require(session_id)
        try:
            req = pb.ExpectDeltaRequest.FromString(body)
        except DecodeError:
            raise InvalidArgument("request", "not an ExpectDeltaRequest") from None
        breach = self.limits.breach(req) if self.limits is not None else None
        if breach:
            field, _, why = breach.partition(": ")
            raise InvalidArgument(field, why)
        if not request_id:
            return (await self._expect(req, session_id)).SerializeToString()
        task = self.replay.run((session_id, request_id), lambda: self._expect(req, session_id))
        # NOTE: shielded: the engine's lane closing must not cancel a call that already started
        return (await asyncio.shield(task)).SerializeToString()  # type: ignore[no-any-return]

    async def _claim(self, request: pb.ClaimRequest, session_id: str) -> pb.ClaimResponse:
        rec, us = await claim(
            self.node.transfers.landing,
            session_id,
            request.transfer_id,
            request.buffer_set_id,
            request.dst_page_indices,
            request.wait_ms,
            convert.aux_rows(request.aux),
        )
        return pb.ClaimResponse(status=convert.transfer_status(rec), claim_us=us)

    @grpc_errors
    @replayable
    async def Claim(self, request: pb.ClaimRequest, context: Ctx) -> pb.ClaimResponse:
        return await self._claim(request, self._session(context))

    async def _send(self, request: pb.SendDeltaRequest, session_id: str) -> pb.SendDeltaResponse:
        self.node.check_accepting("SendDelta")
        engine = self.node.transfers
        trace.mark(request.transfer_id, "send_rpc")
        out, chunk = build_chunk(
            engine,
            session_id,
            transfer_id=request.transfer_id,
            buffer_set_id=request.buffer_set_id,
            chunk_offset=request.chunk_offset,
            src_page_indices=request.src_page_indices,
            last_chunk=request.last_chunk,
            peer_address=request.peer_address,
            aux=convert.aux_rows(request.aux),
            deadline_ms=request.deadline_ms,
            path=convert.path_name(request.path),
            no_duplicate_mark=request.no_duplicate_mark,
        )
        rec = await engine.send(out, chunk)
        return pb.SendDeltaResponse(status=convert.transfer_status(rec))

    async def _abort(self, request: pb.AbortRequest, session_id: str) -> pb.AbortResponse:
        recs = await self.node.transfers.abort(
            session_id, request.transfer_id, "ABORTED", request.reason or "aborted by the engine"
        )
        return pb.AbortResponse(statuses=[convert.transfer_status(r) for r in recs])

    @grpc_errors
    @replayable
    async def ExpectDelta(self, request: pb.ExpectDeltaRequest, context: Ctx) -> pb.ExpectDeltaResponse:
        return await self._expect(request, self._session(context))

    @grpc_errors
    @replayable
    async def SendDelta(self, request: pb.SendDeltaRequest, context: Ctx) -> pb.SendDeltaResponse:
        return await self._send(request, self._session(context))

    @grpc_errors
    async def Poll(self, request: pb.PollRequest, context: Ctx) -> pb.PollResponse:
        recs = self.node.transfers.records(self._session(context), request.transfer_ids)
        return pb.PollResponse(statuses=[convert.transfer_status(r) for r in recs])

    @grpc_errors
    async def WatchTransfers(
        self, request: pb.WatchTransfersRequest, context: Ctx
    ) -> AsyncIterator[pb.TransferStatus]:
        watched = self.node.transfers.watch(
            self._session(context), request.transfer_ids, request.include_current
        )
        async for rec in watched:
            yield convert.transfer_status(rec)

    @grpc_errors
    @replayable
    async def Abort(self, request: pb.AbortRequest, context: Ctx) -> pb.AbortResponse:
        return await self._abort(request, self._session(context))

    @grpc_errors
    async def Transfers(
        self, request_iterator: AsyncIterator[pb.TransferCall], context: Ctx
    ) -> AsyncIterator[pb.TransferEvent]:
        stream = TransferStream(
            self._session(context),
            self.node.transfers,
            self.replay,
            self._expect,
            self._send,
            self._abort,
            self.limits,
            claim=self._claim,
        )
        async for event in stream.serve(request_iterator):
            yield event

    @grpc_errors
    async def SuggestEvictions(
        self, request: pb.SuggestEvictionsRequest, context: Ctx
    ) -> pb.SuggestEvictionsResponse:
        pages, prios, dup = await self.node.suggest_evictions(
            self._session(context), request.buffer_set_id, request.max_pages
        )
        return pb.SuggestEvictionsResponse(
            page_indices=pages.tolist(), priorities=prios.tolist(), duplicated=dup.tolist()
        )

    @grpc_errors
    async def GetStats(self, request: pb.GetStatsRequest, context: Ctx) -> pb.GetStatsResponse:
        sid = convert.session_of(context)
        viewer = self.admins.viewer(
            self.node.sessions.find(sid) if sid else None,
            credential=convert.metadata_value(context, CREDENTIAL_METADATA_KEY) or "",
            certificate=certificate_identity(context),
            bearer=convert.metadata_value(context, BEARER_METADATA_KEY) or "",
        )
        if request.probe_peers and viewer.admin:
            await self.rtts.probe(self.node.transfers)
        return stats_response(self.node, viewer, self.activity, self.rtts, request.window_ms)
