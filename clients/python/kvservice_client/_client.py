"""Synchronous client. Every method maps grpc errors to the client exception tree.

The client opens an ownership session on first use (a server stream held by a background
thread): buffer sets, leases and transfers it creates belong to that session and are released
by the service when the client closes or its process dies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from . import _requests as rq
from ._errors import KVClientError, Unavailable, map_rpc_error
from ._layout import Layout
from ._proto import kvservice_pb2 as pb
from ._proto import kvservice_pb2_grpc
from ._regions import AuxSpec, Region
from ._types import MatchResult, RegisteredBuffers, TransferStatus

__all__ = ["Client", "channel_options"]


def channel_options(max_message_mb: int = 64) -> list[tuple[str, Any]]:
    size = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class Client:
    """Blocking client for one kvservice (``target``: "unix:/path" or "host:port")."""

    def __init__(self, target: str, *, client_name: str = "", timeout: float = 30.0) -> None:
        self.target = target
        self.client_name = client_name
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=channel_options())
        self._stub = kvservice_pb2_grpc.KVServiceStub(self._channel)
        self._session_id = ""
        self._session_call: Any = None
        self._session_ready = threading.Event()
        self._session_error: KVClientError | None = None
        self._lock = threading.Lock()

    # -- session ---------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        """Open the session if needed and return its id."""
        with self._lock:
            if not self._session_call:
                self._session_call = self._stub.OpenSession(
                    pb.OpenSessionRequest(client_name=self.client_name)
                )
                threading.Thread(target=self._hold_session, name="kvservice-session", daemon=True).start()
        if not self._session_ready.wait(self.timeout):
            raise Unavailable(f"no session from {self.target} within {self.timeout}s")
        if self._session_error is not None:
            raise self._session_error
        return self._session_id

    def _hold_session(self) -> None:
        try:
            for event in self._session_call:
                if not self._session_id:
                    self._session_id = event.session_id
                    self._session_ready.set()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._session_error = map_rpc_error(exc)
        finally:
            if not self._session_id and self._session_error is None:
                self._session_error = Unavailable("session stream ended before it started")
            self._session_ready.set()

    def _call(self, method: str, request: Any, owned: bool = True) -> Any:
        metadata = ((rq.SESSION_METADATA_KEY, self.session_id),) if owned else ()
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise map_rpc_error(exc) from None

    def close(self) -> None:
        """End the session (the service releases what it owns) and close the channel."""
        if self._session_call is not None:
            self._session_call.cancel()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- buffers ---------------------------------------------------------------------------
    def register_buffers(
        self,
        layout: Layout,
        k_regions: Sequence[Region],
        v_regions: Sequence[Region] = (),
        aux: Sequence[AuxSpec] = (),
        engine_id: str = "",
    ) -> RegisteredBuffers:
        r = self._call("RegisterBuffers", rq.register(layout, k_regions, v_regions, aux, engine_id))
        return RegisteredBuffers(r.buffer_set_id, r.page_bytes_k, r.page_bytes_v)

    def unregister_buffers(self, buffer_set_id: str) -> pb.UnregisterBuffersResponse:
        return self._call("UnregisterBuffers", pb.UnregisterBuffersRequest(buffer_set_id=buffer_set_id))

    # -- index -----------------------------------------------------------------------------
    def match_prefix(
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
        return MatchResult.from_proto(self._call("MatchPrefix", req, owned=lease_ttl_ms > 0))

    def release_lease(self, lease_id: str) -> None:
        self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))

    def publish_pages(
        self,
        buffer_set_id: str,
        page_indices: Iterable[int] | np.ndarray,
        *,
        tokens: rq.TokensLike | None = None,
        hashes: rq.HashesLike | None = None,
        priority: int = 0,
    ) -> int:
        req = rq.publish(buffer_set_id, page_indices, tokens, hashes, priority)
        return int(self._call("PublishPages", req).inserted_pages)

    def evict_pages(self, buffer_set_id: str, page_indices: Iterable[int] = (), *, all: bool = False) -> int:
        req = pb.EvictPagesRequest(
            buffer_set_id=buffer_set_id, page_indices=rq._idx(page_indices, "page_indices"), all=all
        )
        return int(self._call("EvictPages", req).evicted_pages)

    # -- transfers -------------------------------------------------------------------------
    def expect_delta(
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
        return TransferStatus.from_proto(self._call("ExpectDelta", req).status)

    def send_delta(
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
        return TransferStatus.from_proto(self._call("SendDelta", req).status)

    def poll(self, transfer_ids: Sequence[str] = ()) -> list[TransferStatus]:
        r = self._call("Poll", pb.PollRequest(transfer_ids=list(transfer_ids)))
        return [TransferStatus.from_proto(s) for s in r.statuses]

    def watch(
        self, transfer_ids: Sequence[str] = (), include_current: bool = True
    ) -> Iterator[TransferStatus]:
        """Stream status changes until the caller stops iterating (or the server ends)."""
        req = pb.WatchTransfersRequest(transfer_ids=list(transfer_ids), include_current=include_current)
        call = self._stub.WatchTransfers(req, metadata=((rq.SESSION_METADATA_KEY, self.session_id),))
        try:
            for status in call:
                yield TransferStatus.from_proto(status)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise map_rpc_error(exc) from None
        finally:
            call.cancel()

    def wait(self, transfer_id: str, timeout: float | None = None) -> list[TransferStatus]:
        """Block until every status of ``transfer_id`` on this node is terminal; return them.

        Raises DeadlineExceeded when ``timeout`` (default: the client's) passes first.
        """
        latest: dict[tuple[str, str], TransferStatus] = {}
        req = pb.WatchTransfersRequest(transfer_ids=[transfer_id], include_current=True)
        call = self._stub.WatchTransfers(
            req, timeout=timeout or self.timeout, metadata=((rq.SESSION_METADATA_KEY, self.session_id),)
        )
        try:
            for status in call:
                st = TransferStatus.from_proto(status)
                latest[(st.role, st.buffer_set_id)] = st
                if all(s.terminal for s in latest.values()):
                    return list(latest.values())
        except grpc.RpcError as exc:
            raise map_rpc_error(exc) from None
        finally:
            call.cancel()
        raise Unavailable("status stream ended before the transfer did")

    def abort(self, transfer_id: str, reason: str = "") -> list[TransferStatus]:
        r = self._call("Abort", pb.AbortRequest(transfer_id=transfer_id, reason=reason))
        return [TransferStatus.from_proto(s) for s in r.statuses]

    def get_stats(self) -> pb.GetStatsResponse:
        return self._call("GetStats", pb.GetStatsRequest(), owned=False)
