"""asyncio client (grpc.aio); same methods and results as :class:`Client`, awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from . import _requests as rq
from . import lane_wire
from ._aio_session import AsyncSessionKeeper
from ._client import channel_options
from ._errors import KVClientError, SessionLost, Unauthenticated, map_rpc_error
from ._keepalive import DEFAULT_KEEPALIVE, KeepalivePolicy
from ._landing import AsyncLandingCalls
from ._lane import LaneOpener
from ._lane_send import LaneSend
from ._layout import Layout
from ._local_identity import CREDENTIAL_METADATA_KEY, fetch_credential_async
from ._proto import kvservice_pb2 as pb
from ._proto import kvservice_pb2_grpc
from ._regions import AuxSpec, Region
from ._security import PLAIN, ChannelSecurity
from ._session import Owned, RegisterArgs, find_credential_path
from ._transfer_stream import Ended
from ._types import MatchResult, Offloaded, RegisteredBuffers, TransferStatus

__all__ = ["AsyncClient"]


class AsyncClient(AsyncLandingCalls):
    """Non-blocking client; use ``async with AsyncClient(target) as kv``.

    Sessions behave as in :class:`Client`: resumed after a broken stream, :class:`SessionLost`
    (also passed to ``on_session_lost``, which may be a coroutine function) once they cannot be.
    """

    def __init__(
        self,
        target: str,
        *,
        client_name: str = "",
        timeout: float = 30.0,
        keepalive: KeepalivePolicy = DEFAULT_KEEPALIVE,
        on_session_lost: Callable[[SessionLost], Any] | None = None,
        credential_path: str | None = None,
        security: ChannelSecurity = PLAIN,
        lane: bool = True,
        lane_spin_us: int | None = None,
    ) -> None:
        self.target = target
        self.client_name = client_name
        self.timeout = timeout
        self._channel = security.aio_channel(target, channel_options(keepalive=keepalive))
        self._stub = kvservice_pb2_grpc.KVServiceStub(self._channel)
        self.owned = Owned()
        # SendDelta on the lane, as the sync client (its ENDs are also on WatchTransfers, which
        # this client's waiters read: the book only keeps them)
        self._lane = LaneOpener(target, Ended(), lane, lane_spin_us)
        self._lane_send = LaneSend(self._lane, self._lane.book, self.owned, timeout)
        self._credential_path = find_credential_path(target, credential_path)
        self._session = AsyncSessionKeeper(
            self._stub, client_name, target, self.owned, on_session_lost, self._credential_path
        )

    async def session_id(self) -> str:
        """Open the session if needed (or wait out a resume) and return its id."""
        return await self._session.current(self.timeout)

    async def service_peer_address(self) -> str:
        """The address other kvservices reach the service at; see
        :attr:`Client.service_peer_address` (opens the session if needed; "" from older services).
        """
        await self._session.current(self.timeout)
        return self._session.peer_address

    @property
    def session_resumes(self) -> int:
        return self._session.resumes

    async def reopen_session(self, reregister: bool = True) -> dict[str, RegisteredBuffers]:
        """After SessionLost: a new session; see :meth:`Client.reopen_session`."""
        await self._session.reset()
        old = self.owned.take_buffer_sets()
        if not reregister:
            return {}
        return {
            bs_id: await self.register_buffers(
                a.layout,
                a.k_regions,
                a.v_regions,
                a.aux,
                a.engine_id,
                inbound_max_transfers=a.inbound_max_transfers,
                inbound_max_bytes=a.inbound_max_bytes,
            )  # fmt: skip
            for bs_id, a in old.items()
        }

    async def _identified(self) -> tuple[tuple[str, str], ...]:
        """The open session, else a fresh local credential (see :meth:`Client._identified`)."""
        sid = self._session.peek()
        if sid:
            return ((rq.SESSION_METADATA_KEY, sid),)
        cred = await fetch_credential_async(self._credential_path) if self._credential_path else ""
        return ((CREDENTIAL_METADATA_KEY, cred),) if cred else ()

    async def _call(self, method: str, request: Any, owned: bool = True, request_id: str = "") -> Any:
        if not owned:
            try:
                md = await self._identified()
                return await getattr(self._stub, method)(request, timeout=self.timeout, metadata=md)
            except grpc.RpcError as exc:
                raise map_rpc_error(exc) from None
        metadata = rq.owned_metadata(await self.session_id(), request_id)
        end = time.monotonic() + self.timeout
        while True:  # as Client._call: a try a broken connection cut short is made again
            try:
                return await getattr(self._stub, method)(
                    request, timeout=max(1e-3, end - time.monotonic()), metadata=metadata, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                if not rq.connection_broke(exc) or time.monotonic() + rq.RETRY_PAUSE_S >= end:
                    raise await self._owned_error(exc) from None
            await asyncio.sleep(rq.RETRY_PAUSE_S)

    async def _owned_error(self, exc: grpc.RpcError) -> KVClientError:
        err = map_rpc_error(exc)
        if isinstance(err, Unauthenticated) and rq.SESSION_RELEASED in err.message:
            return await self._session.mark_lost(err.message)
        return err

    @property
    def lane_sent(self) -> int:
        """Chunks this client sent over the lane."""
        return self._lane.sent

    async def close(self) -> None:
        self._lane.close()
        await self._session.close(self._close_rpc)
        await self._channel.close()

    async def _close_rpc(self, session_id: str) -> None:
        try:
            await self._stub.CloseSession(
                pb.CloseSessionRequest(),
                timeout=min(self.timeout, 5.0),
                metadata=((rq.SESSION_METADATA_KEY, session_id),),
            )
        except grpc.RpcError as exc:
            raise map_rpc_error(exc) from None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def register_buffers(
        self,
        layout: Layout,
        k_regions: Sequence[Region],
        v_regions: Sequence[Region] = (),
        aux: Sequence[AuxSpec] = (),
        engine_id: str = "",
        *,
        inbound_max_transfers: int = 0,
        inbound_max_bytes: int = 0,
    ) -> RegisteredBuffers:
        """``inbound_max_*``: this buffer set's inbound budget (0: the service default); over it
        ExpectDelta is refused at once with RESOURCE_EXHAUSTED (see TransferLoad)."""
        args = RegisterArgs(
            layout, tuple(k_regions), tuple(v_regions), tuple(aux), engine_id,
            inbound_max_transfers, inbound_max_bytes,
        )  # fmt: skip
        r = await self._call("RegisterBuffers", rq.register(args))
        self.owned.add_buffer_set(r.buffer_set_id, args)
        return RegisteredBuffers(r.buffer_set_id, r.page_bytes_k, r.page_bytes_v)

    async def unregister_buffers(self, buffer_set_id: str) -> pb.UnregisterBuffersResponse:
        r = await self._call("UnregisterBuffers", pb.UnregisterBuffersRequest(buffer_set_id=buffer_set_id))
        self.owned.drop_buffer_set(buffer_set_id)
        return r

    async def match_prefix(
        self,
        *,
        tokens: rq.TokensLike | None = None,
        hashes: rq.HashesLike | None = None,
        page_size: int = 0,
        buffer_set_ids: Sequence[str] = (),
        dp_rank: int | None = None,
        scores_only: bool = False,
        lease_ttl_ms: int = 0,
    ) -> MatchResult:
        """Which buffer sets hold the longest prefix of ``tokens`` (or ``hashes``). Deliberately
        outside the session unless ``lease_ttl_ms`` asks for a lease (a lease is owned by the
        session, so then the call opens it): routers ask without ever opening one.
        """
        req = rq.match(tokens, hashes, page_size, buffer_set_ids, dp_rank, scores_only, lease_ttl_ms)
        result = MatchResult.from_proto(await self._call("MatchPrefix", req, owned=lease_ttl_ms > 0))
        self.owned.add_lease(result.lease_id, result.lease_expires_unix_ms)
        return result

    async def release_lease(self, lease_id: str) -> None:
        await self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))
        self.owned.drop_lease(lease_id)

    async def publish_pages(
        self,
        buffer_set_id: str,
        page_indices: Iterable[int] | np.ndarray,
        *,
        tokens: rq.TokensLike | None = None,
        hashes: rq.HashesLike | None = None,
        priority: int = 0,
    ) -> int:
        req = rq.publish(buffer_set_id, page_indices, tokens, hashes, priority)
        return int((await self._call("PublishPages", req)).inserted_pages)

    async def evict_pages(
        self, buffer_set_id: str, page_indices: Iterable[int] = (), *, all: bool = False
    ) -> int:
        req = pb.EvictPagesRequest(
            buffer_set_id=buffer_set_id, page_indices=rq._idx(page_indices, "page_indices"), all=all
        )
        return int((await self._call("EvictPages", req)).evicted_pages)

    async def offload_pages(
        self,
        buffer_set_id: str,
        page_indices: Iterable[int] | np.ndarray,
        hashes: rq.HashesLike | None = None,
    ) -> Offloaded:
        """See ``Client.offload_pages``."""
        req = rq.offload(buffer_set_id, page_indices, hashes)
        return Offloaded.from_proto(await self._call("OffloadPages", req))

    async def load_pages(
        self, buffer_set_id: str, page_indices: Iterable[int] | np.ndarray, hashes: rq.HashesLike
    ) -> int:
        """See ``Client.load_pages``."""
        req = rq.load(buffer_set_id, page_indices, hashes)
        return int((await self._call("LoadPages", req)).loaded_pages)

    async def expect_delta(
        self,
        transfer_id: str,
        buffer_set_id: str,
        *,
        prefix_pages: int,
        dst_page_indices: Iterable[int] | np.ndarray,
        expected_senders: int = 0,
        deadline_ms: int = 0,
        aux: Mapping[str, Iterable[int]] | None = None,
        publish_tokens: rq.TokensLike | None = None,
        prefix_page_indices: Iterable[int] | np.ndarray = (),
        allowed_senders: Iterable[str] = (),
        sender_address: str = "",
        from_tier: bool = False,
    ) -> TransferStatus:
        """Declare transfer ``transfer_id`` into this client's buffer set. ``sender_address``: the
        sending engine's kvservice, when known; the service then lets only that service's proven
        identity fetch the plan (``allowed_senders`` filled for you, see docs/design/security.md).
        ``from_tier``: the leading pages past the prefix that the node's host tier holds (by the
        hashes of ``publish_tokens``, required then) are copied from the tier before this returns,
        and the senders skip them like the prefix."""
        req = rq.expect(
            transfer_id,
            buffer_set_id,
            prefix_pages,
            dst_page_indices,
            expected_senders,
            deadline_ms,
            aux,
            publish_tokens,
            prefix_page_indices,
            allowed_senders,
        )
        req.sender_address = sender_address
        req.from_tier = from_tier
        rid = rq.new_request_id()
        resp = None
        # on the lane when the service answers CALLs there (this client's ends come from
        # WatchTransfers and Poll, whichever route declared the transfer)
        lane = self._lane.get(await self.session_id())
        if lane is not None and "expect_delta" in lane.calls_served:
            body = await lane.call_async(lane_wire.CALL_EXPECT, rid, req.SerializeToString(), self.timeout)
            resp = pb.ExpectDeltaResponse.FromString(body) if body is not None else None
        if resp is None:  # fallback: the same request id (a call the lane lost runs once)
            resp = await self._call("ExpectDelta", req, request_id=rid)
        status = TransferStatus.from_proto(resp.status)
        self.owned.add_transfer(transfer_id)
        return status

    async def send_delta(
        self,
        transfer_id: str,
        buffer_set_id: str,
        *,
        src_page_indices: Iterable[int] | np.ndarray,
        peer_address: str,
        chunk_offset: int = 0,
        last_chunk: bool = True,
        aux: Mapping[str, Iterable[int]] | None = None,
        deadline_ms: int = 0,
        path: str = "auto",
        no_duplicate_mark: bool = False,
    ) -> TransferStatus:
        """Queue a chunk of transfer ``transfer_id`` towards ``peer_address``.

        ``no_duplicate_mark``: this engine will need the pages again (the conversation's next
        turn comes back here), so the service must not mark them as a P/D duplicate at DONE.
        On the lane when the service takes it there (a few µs of this thread: no await).
        """
        sent = self._lane_send.try_send(
            await self.session_id(),
            transfer_id,
            buffer_set_id,
            src_page_indices,
            peer_address,
            chunk_offset,
            last_chunk,
            aux,
            path,
            no_duplicate_mark,
        )
        if sent is not None:
            return sent
        req = rq.send(
            transfer_id,
            buffer_set_id,
            src_page_indices,
            chunk_offset,
            last_chunk,
            peer_address,
            aux,
            deadline_ms,
            path,
            no_duplicate_mark,
        )
        status = TransferStatus.from_proto((await self._call("SendDelta", req)).status)
        self.owned.add_transfer(transfer_id)
        return status

    async def poll(self, transfer_ids: Sequence[str] = ()) -> list[TransferStatus]:
        r = await self._call("Poll", pb.PollRequest(transfer_ids=list(transfer_ids)))
        statuses = [TransferStatus.from_proto(s) for s in r.statuses]
        self.owned.observe(statuses)
        return statuses

    async def watch(
        self, transfer_ids: Sequence[str] = (), include_current: bool = True
    ) -> AsyncIterator[TransferStatus]:
        """Stream status changes; reopened after a transport break (see :meth:`Client.watch`)."""
        req = pb.WatchTransfersRequest(transfer_ids=list(transfer_ids), include_current=include_current)
        while True:
            metadata = ((rq.SESSION_METADATA_KEY, await self.session_id()),)
            call = self._stub.WatchTransfers(req, metadata=metadata, wait_for_ready=True)
            try:
                async for status in call:
                    st = TransferStatus.from_proto(status)
                    self.owned.observe((st,))
                    yield st
                return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED:
                    return
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise await self._owned_error(exc) from None
                req.include_current = True  # a change may have happened while disconnected
            finally:
                call.cancel()

    async def abort(self, transfer_id: str, reason: str = "") -> list[TransferStatus]:
        r = await self._call("Abort", pb.AbortRequest(transfer_id=transfer_id, reason=reason))
        statuses = [TransferStatus.from_proto(s) for s in r.statuses]
        self.owned.observe(statuses)
        return statuses

    async def get_stats(self, *, window_ms: int = 0, probe_peers: bool = False) -> pb.GetStatsResponse:
        """Operator view, in this client's session from the first call (the call opens it when
        needed), so what it lists depends on who the client is, never on earlier calls: every buffer
        set, session and peer for an admin (a uid in ``admin_uids`` over the socket; an admin
        certificate or token over TCP), this session's own otherwise (``scope_note`` says so).
        ``window_ms``: span of ``activity`` (0: 10 s); ``probe_peers``: measure peer round trips now.
        """
        req = pb.GetStatsRequest(window_ms=window_ms, probe_peers=probe_peers)
        return await self._call("GetStats", req)
