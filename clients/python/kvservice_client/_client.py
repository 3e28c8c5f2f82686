"""Synchronous client. Every method maps grpc errors to the client exception tree.

The client opens an ownership session on first use (a server stream held by a background
thread): buffer sets, leases and transfers it creates belong to that session and are released
by the service when the client closes or its process dies.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from . import _requests as rq
from . import lane_wire
from ._errors import (
    DeadlineExceeded,
    KVClientError,
    SessionLost,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    map_rpc_error,
)
from ._keepalive import DEFAULT_KEEPALIVE, KeepalivePolicy
from ._landing import LandingCalls
from ._lane import LaneOpener
from ._lane_send import LaneSend
from ._layout import Layout
from ._proto import kvservice_pb2 as pb
from ._proto import kvservice_pb2_grpc
from ._regions import AuxSpec, Region
from ._security import PLAIN, ChannelSecurity
from ._session import (
    CREDENTIAL_METADATA_KEY,
    Owned,
    RegisterArgs,
    SessionKeeper,
    fetch_credential,
    find_credential_path,
)
from ._transfer_stream import Ended, StreamBroken, TransferStream
from ._types import EvictionSuggestion, MatchResult, Offloaded, RegisteredBuffers, TransferStatus

__all__ = ["Client", "channel_options", "message_size_options"]


def message_size_options(max_message_mb: int = 64) -> list[tuple[str, Any]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def channel_options(
    max_message_mb: int = 64, keepalive: KeepalivePolicy = DEFAULT_KEEPALIVE
) -> list[tuple[str, Any]]:
    """Channel arguments of SDK clients (and of peer clients between services)."""
    return message_size_options(max_message_mb) + keepalive.client_options()


class Client(LandingCalls):
    """Blocking client for one kvservice (``target``: "unix:/path" or "host:port").

    ``on_session_lost`` (optional) is called on a background thread with the
    :class:`SessionLost` when the session could not be resumed; owned calls raise it too.
    ``credential_path``: the service's credential socket, from which the client proves its local
    identity (needed to register memory); default ``<socket>.cred`` for "unix:" targets, none for
    TCP targets (pass it to register over TCP on the same host; "" turns it off).
    ``security``: TLS files and/or a bearer token file for a TCP service that requires them
    (:class:`ChannelSecurity`); Unix-socket targets need none.
    ``transfer_stream``: make ExpectDelta / SendDelta / Abort on the session's Transfers stream
    (one held stream; ended transfers arrive on it, so :meth:`wait` opens no watch). False, or
    a service without that RPC: unary calls and a watch per wait.
    ``lane_spin_us``: how long a thread waiting for the lane's answer polls before it sleeps
    (None: ``KVSERVICE_LANE_SPIN_US``, else what the service advises: its ``lane_wait_spin_us``,
    5 ms on a GPU lane by default); each try releases the GIL.
    """

    def __init__(
        self,
        target: str,
        *,
        client_name: str = "",
        timeout: float = 30.0,
        keepalive: KeepalivePolicy = DEFAULT_KEEPALIVE,
        on_session_lost: Callable[[SessionLost], None] | None = None,
        credential_path: str | None = None,
        security: ChannelSecurity = PLAIN,
        transfer_stream: bool = True,
        lane: bool = True,
        lane_spin_us: int | None = None,
    ) -> None:
        self.target = target
        self.client_name = client_name
        self.timeout = timeout
        self._channel = security.channel(target, channel_options(keepalive=keepalive))
        self._stub = kvservice_pb2_grpc.KVServiceStub(self._channel)
        self.owned = Owned()
        self._tx_book = Ended()
        self._tx: TransferStream | None = None
        self._tx_lock = threading.Lock()
        self._tx_enabled = transfer_stream
        if lane_spin_us is None and os.environ.get("KVSERVICE_LANE_SPIN_US", ""):
            lane_spin_us = int(os.environ["KVSERVICE_LANE_SPIN_US"])
        # same-node transfers without gRPC
        self._lane = LaneOpener(target, self._tx_book, lane, lane_spin_us)
        self._lane_send = LaneSend(self._lane, self._tx_book, self.owned, timeout)
        if self._lane.enabled:  # wait() reads the lane on the waiting thread (see _lane)
            self._tx_book.pump, self._tx_book.wake = self._lane.pump, self._lane.wake
        self._credential_path = find_credential_path(target, credential_path)
        self._session = SessionKeeper(
            self._stub, client_name, target, self.owned, on_session_lost, self._credential_path
        )

    # -- session ---------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        """Open the session if needed (or wait out a resume) and return its id."""
        return self._session.current(self.timeout)

    @property
    def service_peer_address(self) -> str:
        """The address that names this client's service on every node, as the service tells each
        session (its ``advertise_address``, else a peer TCP listener bound to a named host). A
        prefill engine names it as the sender of its transfers, so the decode's service lets only
        that service fetch the plan (ExpectDelta's ``sender_address``). Opens the session if
        needed; "" when the service announces none or is older and sends none.
        """
        self._session.current(self.timeout)
        return self._session.peer_address

    @property
    def lane_sent(self) -> int:
        """Transfers this client handed to its service's native lane (see ``lane_wire``)."""
        return self._lane.sent

    @property
    def session_resumes(self) -> int:
        """How many times the session stream broke and was resumed."""
        return self._session.resumes

    def reopen_session(self, reregister: bool = True) -> dict[str, RegisteredBuffers]:
        """After SessionLost: open a new session; with ``reregister``, register again every buffer
        set the lost session owned (same regions). Returns {old buffer_set_id: new registration}.
        """
        self._session.reset()
        old = self.owned.take_buffer_sets()
        if not reregister:
            return {}
        return {
            bs_id: self.register_buffers(
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

    def _transfer_stream(self) -> TransferStream | None:
        """The session's Transfers stream, opened (again) if needed; None when not used."""
        with self._tx_lock:
            tx = self._tx
            if tx is not None and tx.closed and isinstance(tx.error, Unimplemented):
                self._tx_enabled = False  # an older service: unary calls from now on
            if not self._tx_enabled:
                return None
            if tx is None or tx.closed:
                md = ((rq.SESSION_METADATA_KEY, self.session_id),)
                tx = self._tx = TransferStream(self._stub, md, self._tx_book)
            return tx

    def _transfer_call(self, which: str, method: str, request: Any, rid: str = "") -> Any:
        """A transfer call on the stream; made again unary (same request id) if the stream broke."""
        rid = rid or rq.new_request_id()
        tx = self._transfer_stream()
        if tx is not None:
            try:
                return tx.call(which, request, rid, self.timeout)
            except StreamBroken:
                pass
            except TimeoutError:
                raise DeadlineExceeded(f"{method}: no answer within {self.timeout} s") from None
        if getattr(request, "transfer_id", ""):
            self._tx_book.unsure(request.transfer_id)
        return self._call(method, request, request_id=rid)

    def _identified(self) -> tuple[tuple[str, str], ...]:
        """Metadata naming who calls without owning anything: the open session, else a fresh local
        credential (a service with ``allowed_uids`` refuses anonymous calls on its socket)."""
        sid = self._session.peek()
        if sid:
            return ((rq.SESSION_METADATA_KEY, sid),)
        cred = fetch_credential(self._credential_path)
        return ((CREDENTIAL_METADATA_KEY, cred),) if cred else ()

    def _call(self, method: str, request: Any, owned: bool = True, request_id: str = "") -> Any:
        if not owned:
            try:
                return getattr(self._stub, method)(request, timeout=self.timeout, metadata=self._identified())
            except grpc.RpcError as exc:
                raise map_rpc_error(exc) from None
        metadata = rq.owned_metadata(self.session_id, request_id)
        end = time.monotonic() + self.timeout
        while True:
            try:
                # NOTE: an owned call waits for a broken connection to come back (the session is
                # being resumed meanwhile) instead of failing at once; a try the break cut short
                # is made again with the same request id (the service runs it at most once).
                return getattr(self._stub, method)(
                    request, timeout=max(1e-3, end - time.monotonic()), metadata=metadata, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                if not rq.connection_broke(exc) or time.monotonic() + rq.RETRY_PAUSE_S >= end:
                    raise self._owned_error(exc) from None
            time.sleep(rq.RETRY_PAUSE_S)

    def _owned_error(self, exc: grpc.RpcError) -> KVClientError:
        err = map_rpc_error(exc)
        if isinstance(err, Unauthenticated) and rq.SESSION_RELEASED in err.message:
            return self._session.mark_lost(err.message)
        return err

    def close(self) -> None:
        """End the session (the service releases what it owns at once) and close the channel."""
        self._lane.close()
        with self._tx_lock:
            if self._tx is not None:
                self._tx.close()
        self._session.close(self._close_rpc)
        self._channel.close()

    def _close_rpc(self, session_id: str) -> None:
        try:
            self._stub.CloseSession(
                pb.CloseSessionRequest(),
                timeout=min(self.timeout, 5.0),
                metadata=((rq.SESSION_METADATA_KEY, session_id),),
            )
        except grpc.RpcError as exc:
            raise map_rpc_error(exc) from None

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
        r = self._call("RegisterBuffers", rq.register(args))
        self.owned.add_buffer_set(r.buffer_set_id, args)
        return RegisteredBuffers(r.buffer_set_id, r.page_bytes_k, r.page_bytes_v)

    def unregister_buffers(self, buffer_set_id: str) -> pb.UnregisterBuffersResponse:
        r = self._call("UnregisterBuffers", pb.UnregisterBuffersRequest(buffer_set_id=buffer_set_id))
        self.owned.drop_buffer_set(buffer_set_id)
        return r

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
        """Which buffer sets hold the longest prefix of ``tokens`` (or ``hashes``). Deliberately
        outside the session unless ``lease_ttl_ms`` asks for a lease (a lease is owned by the
        session, so then the call opens it): routers ask without ever opening one.
        """
        req = rq.match(tokens, hashes, page_size, buffer_set_ids, dp_rank, scores_only, lease_ttl_ms)
        result = MatchResult.from_proto(self._call("MatchPrefix", req, owned=lease_ttl_ms > 0))
        self.owned.add_lease(result.lease_id, result.lease_expires_unix_ms)
        return result

    def release_lease(self, lease_id: str) -> None:
        self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))
        self.owned.drop_lease(lease_id)

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

    def on_duplicates(self, fn: Callable[[str, int], None]) -> None:
        """Call ``fn(buffer_set_id, duplicated_pages)`` whenever the service reports that the
        P/D duplicates of one of this session's buffer sets changed (a DONE transfer it sent to
        an engine that indexes the pages, or marks cleared). Runs on the session's stream thread."""

        def listener(event: Any) -> None:
            if event.HasField("duplicates"):
                fn(event.duplicates.buffer_set_id, event.duplicates.duplicated_pages)

        self._session.listeners.append(listener)

    def suggest_evictions(self, buffer_set_id: str, max_pages: int) -> EvictionSuggestion:
        """Pages of the buffer set to evict first (unpinned; lowest priority, then least
        recently used; leaves before parents; verified P/D duplicates carry their lowered
        priority). Evict them in the order given."""
        req = pb.SuggestEvictionsRequest(buffer_set_id=buffer_set_id, max_pages=max_pages)
        return EvictionSuggestion.from_proto(self._call("SuggestEvictions", req))

    def evict_pages(self, buffer_set_id: str, page_indices: Iterable[int] = (), *, all: bool = False) -> int:
        req = pb.EvictPagesRequest(
            buffer_set_id=buffer_set_id, page_indices=rq._idx(page_indices, "page_indices"), all=all
        )
        return int(self._call("EvictPages", req).evicted_pages)

    # -- the node's host tier ----------------------------------------------------------------
    def offload_pages(
        self,
        buffer_set_id: str,
        page_indices: Iterable[int] | np.ndarray,
        hashes: rq.HashesLike | None = None,
    ) -> Offloaded:
        """Keep these pages in the node's host tier; returns once the pages may be overwritten.
        ``hashes``: each page's chained hash (default: the ones the index holds for them)."""
        req = rq.offload(buffer_set_id, page_indices, hashes)
        return Offloaded.from_proto(self._call("OffloadPages", req))

    def load_pages(
        self, buffer_set_id: str, page_indices: Iterable[int] | np.ndarray, hashes: rq.HashesLike
    ) -> int:
        """Write the tier's pages ``hashes`` into ``page_indices`` (all or none: FAILED_PRECONDITION
        naming a hash the tier does not hold); returns the pages written."""
        return int(self._call("LoadPages", rq.load(buffer_set_id, page_indices, hashes)).loaded_pages)

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
        lane = self._lane.get(self.session_id)  # open before the transfer: its END may come this way
        rid = rq.new_request_id()
        resp = None
        # NOTE: on the lane only once the session's Transfers stream answered a call: from then on
        # it reports every end of this session's transfers (the book waits on it and the lane)
        tx = self._tx
        if (
            lane is not None
            and "expect_delta" in lane.calls_served
            and tx is not None
            and tx.answered
            and not tx.closed
        ):
            body = lane.call(lane_wire.CALL_EXPECT, rid, req.SerializeToString(), self.timeout)
            resp = pb.ExpectDeltaResponse.FromString(body) if body is not None else None
        if resp is None:  # fallback: the same request id (a call the lane lost runs once)
            resp = self._transfer_call("expect_delta", "ExpectDelta", req, rid)
        status = TransferStatus.from_proto(resp.status)
        self.owned.add_transfer(transfer_id)
        self._tx_book.made(transfer_id, status.role, status.buffer_set_id)
        return status

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
        no_duplicate_mark: bool = False,
    ) -> TransferStatus:
        """Queue a chunk of transfer ``transfer_id`` towards ``peer_address``.

        ``no_duplicate_mark``: this engine will need the pages again (the conversation's next
        turn comes back here), so the service must not mark them as a P/D duplicate at DONE.
        """
        sent = self._lane_send.try_send(
            self._session.ready_id() or self.session_id,
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
        status = TransferStatus.from_proto(self._transfer_call("send_delta", "SendDelta", req).status)
        self.owned.add_transfer(transfer_id)
        self._tx_book.made(transfer_id, status.role, status.buffer_set_id)
        return status

    def poll(self, transfer_ids: Sequence[str] = ()) -> list[TransferStatus]:
        r = self._call("Poll", pb.PollRequest(transfer_ids=list(transfer_ids)))
        statuses = [TransferStatus.from_proto(s) for s in r.statuses]
        self.owned.observe(statuses)
        return statuses

    def watch(
        self, transfer_ids: Sequence[str] = (), include_current: bool = True
    ) -> Iterator[TransferStatus]:
        """Stream status changes until the caller stops iterating (or the server ends).

        A broken connection is resumed with the session: the stream is reopened with the current
        statuses, so a change is never missed (a status may then repeat).
        """
        return self._statuses(transfer_ids, include_current, None)

    def wait(self, transfer_id: str, timeout: float | None = None) -> list[TransferStatus]:
        """Block until every status of ``transfer_id`` on this node is terminal; return them.

        Raises DeadlineExceeded when ``timeout`` (default: the client's) passes first.
        """
        deadline = time.monotonic() + (timeout or self.timeout)
        try:  # the sides this client made on its Transfers stream: their ends arrive there
            ended = self._tx_book.wait_all(transfer_id, deadline)
        except TimeoutError:
            raise DeadlineExceeded("the transfer did not end before the wait's timeout") from None
        if ended is not None:
            self.owned.observe(ended)
            return ended
        latest: dict[tuple[str, str], TransferStatus] = {}
        statuses = self._statuses([transfer_id], True, deadline)
        try:
            for st in statuses:
                latest[(st.role, st.buffer_set_id)] = st
                if all(s.terminal for s in latest.values()):
                    return list(latest.values())
        finally:
            statuses.close()
        raise Unavailable("status stream ended before the transfer did")

    def _statuses(
        self, transfer_ids: Sequence[str], include_current: bool, deadline: float | None
    ) -> Generator[TransferStatus, None, None]:
        """WatchTransfers, reopened after a transport break until ``deadline`` (None: never)."""
        req = pb.WatchTransfersRequest(transfer_ids=list(transfer_ids), include_current=include_current)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlineExceeded("the transfer did not end before the wait's timeout")
            metadata = ((rq.SESSION_METADATA_KEY, self.session_id),)
            call = self._stub.WatchTransfers(req, timeout=left, metadata=metadata, wait_for_ready=True)
            try:
                for status in call:
                    st = TransferStatus.from_proto(status)
                    self.owned.observe((st,))
                    yield st
                return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED:
                    return
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise self._owned_error(exc) from None
                req.include_current = True  # a change may have happened while disconnected
            finally:
                call.cancel()

    def abort(self, transfer_id: str, reason: str = "") -> list[TransferStatus]:
        r = self._transfer_call("abort", "Abort", pb.AbortRequest(transfer_id=transfer_id, reason=reason))
        statuses = [TransferStatus.from_proto(s) for s in r.statuses]
        self.owned.observe(statuses)
        return statuses

    def get_stats(self, *, window_ms: int = 0, probe_peers: bool = False) -> pb.GetStatsResponse:
        """Operator view, in this client's session from the first call (the call opens it when
        needed), so what it lists depends on who the client is, never on earlier calls: every buffer
        set, session and peer for an admin (a uid in ``admin_uids`` over the socket; an admin
        certificate or token over TCP), this session's own otherwise (``scope_note`` says so).
        ``window_ms``: span of ``activity`` (0: 10 s); ``probe_peers``: measure peer round trips now.
        """
        req = pb.GetStatsRequest(window_ms=window_ms, probe_peers=probe_peers)
        return self._call("GetStats", req)


def ask_service_peer_address(address: str, client_name: str, timeout: float) -> str:
    """:attr:`Client.service_peer_address` of the service at ``address``, from a short session
    of its own (no transfer stream, no lane). Raises what connecting raises (KVClientError,
    OSError, ValueError)."""
    with Client(address, client_name=client_name, timeout=timeout, transfer_stream=False, lane=False) as kv:
        return kv.service_peer_address
