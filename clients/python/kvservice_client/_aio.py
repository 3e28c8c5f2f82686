"""asyncio client (grpc.aio); same methods and results as :class:`Client`, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from . import _requests as rq
from ._client import channel_options
from ._errors import Unavailable, map_rpc_error
from ._layout import Layout
from ._proto import kvservice_pb2 as pb
from ._proto import kvservice_pb2_grpc
from ._regions import AuxSpec, Region
from ._types import MatchResult, RegisteredBuffers, TransferStatus

__all__ = ["AsyncClient"]


class AsyncClient:
    """Non-blocking client; use ``async with AsyncClient(target) as kv``."""

    def __init__(self, target: str, *, client_name: str = "", timeout: float = 30.0) -> None:
        self.target = target
        self.client_name = client_name
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(target, options=channel_options())
        self._stub = kvservice_pb2_grpc.KVServiceStub(self._channel)
        self._session_id = ""
        self._session_call: Any = None
        self._session_task: asyncio.Task[None] | None = None
        self._session_lock = asyncio.Lock()

    async def session_id(self) -> str:
        async with self._session_lock:
            if not self._session_id:
                self._session_call = self._stub.OpenSession(
                    pb.OpenSessionRequest(client_name=self.client_name)
                )
                try:
                    first = await asyncio.wait_for(self._session_call.read(), self.timeout)
                except grpc.RpcError as exc:
                    raise map_rpc_error(exc) from None
                except asyncio.TimeoutError:
                    raise Unavailable(f"no session from {self.target} within {self.timeout}s") from None
                if first is grpc.aio.EOF:
                    raise Unavailable("session stream ended before it started")
                self._session_id = first.session_id
        return self._session_id

    async def _call(self, method: str, request: Any, owned: bool = True) -> Any:
        metadata = ((rq.SESSION_METADATA_KEY, await self.session_id()),) if owned else ()
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise map_rpc_error(exc) from None

    async def close(self) -> None:
        if self._session_call is not None:
            self._session_call.cancel()
        await self._channel.close()

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
    ) -> RegisteredBuffers:
        r = await self._call("RegisterBuffers", rq.register(layout, k_regions, v_regions, aux, engine_id))
        return RegisteredBuffers(r.buffer_set_id, r.page_bytes_k, r.page_bytes_v)

    async def unregister_buffers(self, buffer_set_id: str) -> pb.UnregisterBuffersResponse:
        return await self._call("UnregisterBuffers", pb.UnregisterBuffersRequest(buffer_set_id=buffer_set_id))

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
        req = rq.match(tokens, hashes, page_size, buffer_set_ids, dp_rank, scores_only, lease_ttl_ms)
        return MatchResult.from_proto(await self._call("MatchPrefix", req, owned=lease_ttl_ms > 0))

    async def release_lease(self, lease_id: str) -> None:
        await self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))

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
    ) -> TransferStatus:
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
        )
        return TransferStatus.from_proto((await self._call("ExpectDelta", req)).status)

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
    ) -> TransferStatus:
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
        )
        return TransferStatus.from_proto((await self._call("SendDelta", req)).status)

    async def poll(self, transfer_ids: Sequence[str] = ()) -> list[TransferStatus]:
        r = await self._call("Poll", pb.PollRequest(transfer_ids=list(transfer_ids)))
        return [TransferStatus.from_proto(s) for s in r.statuses]

    async def watch(
        self, transfer_ids: Sequence[str] = (), include_current: bool = True
    ) -> AsyncIterator[TransferStatus]:
        req = pb.WatchTransfersRequest(transfer_ids=list(transfer_ids), include_current=include_current)
        call = self._stub.WatchTransfers(req, metadata=((rq.SESSION_METADATA_KEY, await self.session_id()),))
        try:
            async for status in call:
                yield TransferStatus.from_proto(status)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise map_rpc_error(exc) from None
        finally:
            call.cancel()

    async def abort(self, transfer_id: str, reason: str = "") -> list[TransferStatus]:
        r = await self._call("Abort", pb.AbortRequest(transfer_id=transfer_id, reason=reason))
        return [TransferStatus.from_proto(s) for s in r.statuses]

    async def get_stats(self) -> pb.GetStatsResponse:
        return await self._call("GetStats", pb.GetStatsRequest(), owned=False)
