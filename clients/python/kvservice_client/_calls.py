"""The SDK's calls, each written once as steps (see ``_steps``): the core of both clients.

``Client`` (blocking) and ``AsyncClient`` (awaited) are faces over :class:`Calls` (the plumbing,
the session, buffers, index and tier), ``_transfer_calls.TransferCalls`` and
``_landing.LandingCalls``; what a call sends, how it retries and what it records as owned is
here, how its effects run is in ``_effects``. Every call maps grpc errors to the client
exception tree (``_errors``).

Owned calls carry the session and a request id::

    _call ─▶ SESSION ─▶ Unary(wait_for_ready) ─▶ connection broke? ─▶ Sleep ─▶ again, same id
                                               └▶ a service status ─▶ the mapped error
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np

from . import _requests as rq
from ._effects import SESSION, Credential, OnStream, Read, Sleep, Unary
from ._errors import DeadlineExceeded, KVClientError, SessionLost, Unauthenticated, map_rpc_error
from ._keepalive import DEFAULT_KEEPALIVE, KeepalivePolicy
from ._lane import LaneOpener
from ._lane_send import LaneSend
from ._layout import Layout
from ._local_identity import CREDENTIAL_METADATA_KEY
from ._proto import kvservice_pb2 as pb
from ._regions import AuxSpec, Region
from ._security import PLAIN, ChannelSecurity
from ._session import Owned, RegisterArgs, SessionKeeper, find_credential_path
from ._steps import Emit, Steps, op
from ._transfer_stream import Ended
from ._types import EvictionSuggestion, MatchResult, Offloaded, RegisteredBuffers, TransferStatus

__all__ = ["Calls", "Connecting"]


class Connecting(NamedTuple):
    """What a face's ``_connect`` needs from the constructor's arguments."""

    security: ChannelSecurity
    keepalive: KeepalivePolicy
    on_session_lost: Callable[[SessionLost], Any] | None
    transfer_stream: bool


class Calls:
    """The calls of both clients, and what they share; a face (``Client``, ``AsyncClient``)
    connects in ``_connect``: its channel and stub, and the session keeper."""

    _stub: Any
    _session: SessionKeeper

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
        transfer_stream: bool = True,
        lane: bool = True,
        lane_spin_us: int | None = None,
    ) -> None:
        self.target = target
        self.client_name = client_name
        self.timeout = timeout
        self.owned = Owned()
        self._tx_book = Ended()  # the ends of transfers made on the Transfers stream or the lane
        self._credential_path = find_credential_path(target, credential_path)
        if lane_spin_us is None and os.environ.get("KVSERVICE_LANE_SPIN_US", ""):
            lane_spin_us = int(os.environ["KVSERVICE_LANE_SPIN_US"])
        # same-node transfers without gRPC
        self._lane = LaneOpener(target, self._tx_book, lane, lane_spin_us)
        self._lane_send = LaneSend(self._lane, self._tx_book, self.owned, timeout)
        self._connect(Connecting(security, keepalive, on_session_lost, transfer_stream))

    def _connect(self, how: Connecting) -> None:
        raise NotImplementedError

    @property
    def lane_sent(self) -> int:
        """Transfers this client handed to its service's native lane (see ``lane_wire``)."""
        return self._lane.sent

    @property
    def session_resumes(self) -> int:
        """How many times the session stream broke and was resumed."""
        return self._session.resumes

    def _lane_reports_ends(self) -> bool:
        """Whether a transfer declared on the lane has its end reported where ``wait`` looks."""
        return True

    # -- the plumbing ----------------------------------------------------------------------
    def _identified(self) -> Steps[tuple[tuple[str, str], ...]]:
        """Metadata naming who calls without owning anything: the open session, else a fresh local
        credential (a service with ``allowed_uids`` refuses anonymous calls on its socket)."""
        sid = self._session.peek()
        if sid:
            return ((rq.SESSION_METADATA_KEY, sid),)
        cred = yield Credential()
        return ((CREDENTIAL_METADATA_KEY, cred),) if cred else ()

    def _rpc(self, method: str, request: Any, owned: bool = True, request_id: str = "") -> Steps[Any]:
        """A unary call: owned (in the session, retried through a broken connection under the same
        request id) or not (identified by the open session or a local credential)."""
        if not owned:
            md = yield from self._identified()
            try:
                return (yield Unary(method, request, timeout=self.timeout, metadata=md))
            except grpc.RpcError as exc:
                raise map_rpc_error(exc) from None
        metadata = rq.owned_metadata((yield SESSION), request_id)
        end = time.monotonic() + self.timeout
        while True:
            try:
                # NOTE: an owned call waits for a broken connection to come back (the session is
                # being resumed meanwhile) instead of failing at once; a try the break cut short
                # is made again with the same request id (the service runs it at most once).
                left = max(1e-3, end - time.monotonic())
                return (yield Unary(method, request, timeout=left, metadata=metadata, wait_for_ready=True))
            except grpc.RpcError as exc:
                if not rq.connection_broke(exc) or time.monotonic() + rq.RETRY_PAUSE_S >= end:
                    raise self._owned_error(exc) from None
            yield Sleep(rq.RETRY_PAUSE_S)

    def _owned_error(self, exc: grpc.RpcError) -> KVClientError:
        err = map_rpc_error(exc)
        if isinstance(err, Unauthenticated) and rq.SESSION_RELEASED in err.message:
            return self._session.mark_lost(err.message)
        return err

    _call = op(_rpc)  # also a face method (tests make raw calls with it)

    def _transfer(self, which: str, method: str, request: Any, rid: str = "") -> Steps[Any]:
        """A transfer call on the stream; made again unary (same request id) if the stream broke."""
        rid = rid or rq.new_request_id()
        resp = yield OnStream(which, method, request, rid)
        if resp is not None:
            return resp
        if getattr(request, "transfer_id", ""):
            self._tx_book.unsure(request.transfer_id)
        return (yield from self._rpc(method, request, request_id=rid))

    _transfer_call = op(_transfer)

    def _made(self, transfer_id: str, status: TransferStatus) -> TransferStatus:
        self.owned.add_transfer(transfer_id)
        self._tx_book.made(transfer_id, status.role, status.buffer_set_id)
        return status

    def _observed(self, statuses: Iterable[Any]) -> list[TransferStatus]:
        out = [TransferStatus.from_proto(s) for s in statuses]
        self.owned.observe(out)
        return out

    def _statuses(
        self, transfer_ids: Sequence[str], include_current: bool, deadline: float | None
    ) -> Steps[None]:
        """WatchTransfers, reopened after a transport break until ``deadline`` (None: never)."""
        req = pb.WatchTransfersRequest(transfer_ids=list(transfer_ids), include_current=include_current)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlineExceeded("the transfer did not end before the wait's timeout")
            metadata = ((rq.SESSION_METADATA_KEY, (yield SESSION)),)
            call = self._stub.WatchTransfers(req, timeout=left, metadata=metadata, wait_for_ready=True)
            try:
                while (status := (yield Read(call))) is not None:
                    yield Emit(self._observed((status,))[0])
                return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED:
                    return
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise self._owned_error(exc) from None
                req.include_current = True  # a change may have happened while disconnected
            finally:
                call.cancel()

    # -- session ---------------------------------------------------------------------------
    @op
    def reopen_session(self, reregister: bool = True) -> Steps[dict[str, RegisteredBuffers]]:
        """After SessionLost: open a new session; with ``reregister``, register again every buffer
        set the lost session owned (same regions). Returns {old buffer_set_id: new registration}.
        """
        self._session.reset()
        old = self.owned.take_buffer_sets()
        again: dict[str, RegisteredBuffers] = {}
        for bs_id, a in old.items() if reregister else ():
            again[bs_id] = yield from Calls.register_buffers.fn(
                self, a.layout, a.k_regions, a.v_regions, a.aux, a.engine_id,
                inbound_max_transfers=a.inbound_max_transfers, inbound_max_bytes=a.inbound_max_bytes,
            )  # fmt: skip
        return again

    # -- buffers ---------------------------------------------------------------------------
    @op
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
    ) -> Steps[RegisteredBuffers]:
        """``inbound_max_*``: this buffer set's inbound budget (0: the service default); over it
        ExpectDelta is refused at once with RESOURCE_EXHAUSTED (see TransferLoad)."""
        args = RegisterArgs(
            layout, tuple(k_regions), tuple(v_regions), tuple(aux), engine_id,
            inbound_max_transfers, inbound_max_bytes,
        )  # fmt: skip
        r = yield from self._rpc("RegisterBuffers", rq.register(args))
        self.owned.add_buffer_set(r.buffer_set_id, args)
        return RegisteredBuffers(r.buffer_set_id, r.page_bytes_k, r.page_bytes_v)

    @op
    def unregister_buffers(self, buffer_set_id: str) -> Steps[pb.UnregisterBuffersResponse]:
        req = pb.UnregisterBuffersRequest(buffer_set_id=buffer_set_id)
        r = yield from self._rpc("UnregisterBuffers", req)
        self.owned.drop_buffer_set(buffer_set_id)
        return r

    # -- index -----------------------------------------------------------------------------
    @op
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
    ) -> Steps[MatchResult]:
        """Which buffer sets hold the longest prefix of ``tokens`` (or ``hashes``). Deliberately
        outside the session unless ``lease_ttl_ms`` asks for a lease (a lease is owned by the
        session, so then the call opens it): routers ask without ever opening one.
        """
        req = rq.match(tokens, hashes, page_size, buffer_set_ids, dp_rank, scores_only, lease_ttl_ms)
        result = MatchResult.from_proto((yield from self._rpc("MatchPrefix", req, owned=lease_ttl_ms > 0)))
        self.owned.add_lease(result.lease_id, result.lease_expires_unix_ms)
        return result

    @op
    def release_lease(self, lease_id: str) -> Steps[None]:
        yield from self._rpc("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))
        self.owned.drop_lease(lease_id)

    @op
    def publish_pages(
        self,
        buffer_set_id: str,
        page_indices: Iterable[int] | np.ndarray,
        *,
        tokens: rq.TokensLike | None = None,
        hashes: rq.HashesLike | None = None,
        priority: int = 0,
    ) -> Steps[int]:
        req = rq.publish(buffer_set_id, page_indices, tokens, hashes, priority)
        return int((yield from self._rpc("PublishPages", req)).inserted_pages)

    def on_duplicates(self, fn: Callable[[str, int], None]) -> None:
        """Call ``fn(buffer_set_id, duplicated_pages)`` whenever the service reports that the
        P/D duplicates of one of this session's buffer sets changed (a DONE transfer it sent to
        an engine that indexes the pages, or marks cleared). Runs on the session's stream thread."""

        def listener(event: Any) -> None:
            if event.HasField("duplicates"):
                fn(event.duplicates.buffer_set_id, event.duplicates.duplicated_pages)

        self._session.listeners.append(listener)

    @op
    def suggest_evictions(self, buffer_set_id: str, max_pages: int) -> Steps[EvictionSuggestion]:
        """Pages of the buffer set to evict first (unpinned; lowest priority, then least
        recently used; leaves before parents; verified P/D duplicates carry their lowered
        priority). Evict them in the order given."""
        req = pb.SuggestEvictionsRequest(buffer_set_id=buffer_set_id, max_pages=max_pages)
        return EvictionSuggestion.from_proto((yield from self._rpc("SuggestEvictions", req)))

    @op
    def evict_pages(
        self, buffer_set_id: str, page_indices: Iterable[int] = (), *, all: bool = False
    ) -> Steps[int]:
        indices = rq._idx(page_indices, "page_indices")
        req = pb.EvictPagesRequest(buffer_set_id=buffer_set_id, page_indices=indices, all=all)
        return int((yield from self._rpc("EvictPages", req)).evicted_pages)

    # -- the node's host tier ----------------------------------------------------------------
    @op
    def offload_pages(
        self,
        buffer_set_id: str,
        page_indices: Iterable[int] | np.ndarray,
        hashes: rq.HashesLike | None = None,
    ) -> Steps[Offloaded]:
        """Keep these pages in the node's host tier; returns once the pages may be overwritten.
        ``hashes``: each page's chained hash (default: the ones the index holds for them)."""
        req = rq.offload(buffer_set_id, page_indices, hashes)
        return Offloaded.from_proto((yield from self._rpc("OffloadPages", req)))

    @op
    def load_pages(
        self, buffer_set_id: str, page_indices: Iterable[int] | np.ndarray, hashes: rq.HashesLike
    ) -> Steps[int]:
        """Write the tier's pages ``hashes`` into ``page_indices`` (all or none: FAILED_PRECONDITION
        naming a hash the tier does not hold); returns the pages written."""
        req = rq.load(buffer_set_id, page_indices, hashes)
        return int((yield from self._rpc("LoadPages", req)).loaded_pages)

    @op
    def get_stats(self, *, window_ms: int = 0, probe_peers: bool = False) -> Steps[pb.GetStatsResponse]:
        """Operator view, in this client's session from the first call (the call opens it when
        needed), so what it lists depends on who the client is, never on earlier calls: every buffer
        set, session and peer for an admin (a uid in ``admin_uids`` over the socket; an admin
        certificate or token over TCP), this session's own otherwise (``scope_note`` says so).
        ``window_ms``: span of ``activity`` (0: 10 s); ``probe_peers``: measure peer round trips now.
        """
        req = pb.GetStatsRequest(window_ms=window_ms, probe_peers=probe_peers)
        return (yield from self._rpc("GetStats", req))
