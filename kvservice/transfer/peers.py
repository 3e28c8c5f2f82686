"""Connections to other kvservice instances (the KVPeer API) and their transport agents.

One :class:`PeerClient` per peer address, cached by the :class:`PeerDirectory`. The first use
handshakes (exchange transport metadata, version, capabilities) and loads the peer's agent
into our transport. A peer that restarted answers with a new ``service_id`` and a peer that
registered memory since answers with a higher ``metadata_epoch``: both make us re-handshake
(``refresh``). gRPC failures become UNAVAILABLE / DEADLINE_EXCEEDED from the error tree, so a
lost peer fails the transfers that use it with a reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from kvservice_client.contract import (
    PLAIN,
    ChannelSecurity,
    KeepalivePolicy,
    channel_options,
    credential_path_of,
)
from kvservice_client.proto import peer_pb2, peer_pb2_grpc

from .. import errors, host
from .transport import Transport

if TYPE_CHECKING:
    from .lane import RunningLane
    from .lane.book import NoLane

# NOTE: the lane's start is a module load (tens of ms) once built, a first build ~20 s: a handshake
# waits this long at most, then goes on without the lane's metadata; when the lane comes up later,
# the lane's start makes every peer handshake again (``PeerDirectory.stale``, a new epoch).
LANE_SETTLE_S = 2.0

__all__ = ["CAPABILITIES", "PeerClient", "PeerDirectory", "Self", "error_from_code"]

CAPABILITIES = ("direct", "packed", "mixed_tp", "mla", "aux", "same_host_fused", "channel")

log = logging.getLogger(__name__)

# NOTE: a connection that fails before the call reached the peer (a TLS handshake the peer's end
# closed, a refused connect while it restarts) is UNAVAILABLE at once; the calls that change
# nothing on the peer are tried again by gRPC's own retry policy, within the call's timeout. The
# rest (a plan fetch binds a ticket, a commit unpacks) fail the transfer with the reason instead.
IDEMPOTENT = ("Handshake", "HeldPages")
RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "kvservice.v1.KVPeer", "method": m} for m in IDEMPOTENT],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 4,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

_BY_CODE: dict[grpc.StatusCode, type[errors.KVServiceError]] = {
    cls.code: cls
    for cls in (
        errors.InvalidArgument,
        errors.NotFound,
        errors.AlreadyExists,
        errors.PermissionDenied,
        errors.Unauthenticated,
        errors.FailedPrecondition,
        errors.ResourceExhausted,
        errors.DeadlineExceeded,
        errors.Aborted,
        errors.Unavailable,
        errors.Unimplemented,
    )
}


def _peer_status_error(code: grpc.StatusCode, msg: str) -> errors.KVServiceError:
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.FailedPrecondition(msg)  # the peer rejected what *we* sent: not the caller's field
    return _BY_CODE.get(code, errors.Unavailable)(msg)


def error_from_code(code_name: str, msg: str) -> errors.KVServiceError:
    """A peer's error reported by status code name (channel acks) as our error."""
    try:
        code = grpc.StatusCode[code_name]
    except KeyError:
        return errors.Unavailable(msg)
    return _peer_status_error(code, msg)


def peer_error(address: str, exc: grpc.RpcError) -> errors.KVServiceError:
    """A KVPeer call's failure as our error (the peer's message kept, its address added)."""
    code = exc.code()
    return _peer_status_error(code, f"peer {address}: {exc.details() or code.name}")


class _LocalContext:
    """The slice of a grpc.aio ServicerContext the KVPeer servicer uses, for in-process calls."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _peer_status_error(code, details)

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def peer(self) -> str:
        return "unix:in-process"  # this very service: as local as a peer gets

    def set_trailing_metadata(self, metadata: Any) -> None:
        return  # in-process: the status travels as the exception itself


class Self:
    """What we tell peers about ourselves in a handshake; ``local`` serves our own calls."""

    # NOTE: the one back edge of the wiring: the KVPeer servicer is built on the engine, so
    # build_server attaches it here right after; without it our own calls go over the socket.
    local: peer_pb2_grpc.KVPeerServicer | None = None

    def __init__(
        self, service_id: str, version: str, address: str, transport: Transport, epoch: Callable[[], int]
    ) -> None:
        self.service_id = service_id
        self.version = version
        self.address = address
        self.transport = transport
        self.epoch = epoch  # our metadata epoch
        self.lane: NoLane | None = None  # the lane book: its cross-node agent's metadata
        self.lane_starting: asyncio.Future[RunningLane | None] | None = (
            None  # the lane's start, while it runs
        )

    async def lane_settled(self, timeout: float = LANE_SETTLE_S) -> None:
        """Wait (``timeout`` at most) for the lane's start to end: a handshake either way carries
        and loads cross-node lane metadata (one made before the lane is up is made again once it
        is: see ``PeerDirectory.stale``)."""
        starting = self.lane_starting
        if starting is not None and not starting.done():
            await asyncio.wait({starting}, timeout=timeout)

    def request(self) -> peer_pb2.HandshakeRequest:
        return peer_pb2.HandshakeRequest(
            service_id=self.service_id,
            version=self.version,
            transport=self.transport.kind,
            agent_name=self.transport.agent_name,
            agent_metadata=self.transport.metadata(),
            capabilities=list(CAPABILITIES),
            address=self.address,
            boot_id=host.boot_id(),
            hostname=host.hostname(),
            lane_agent_metadata=self.lane.metadata() if self.lane is not None else b"",
        )


class PeerClient:
    """A handshaken connection to one peer service."""

    def __init__(
        self,
        address: str,
        me: Self,
        options: Sequence[tuple[str, Any]],
        security: ChannelSecurity = PLAIN,
    ) -> None:
        self.address = address
        self._me = me
        self._channel = security.aio_channel(address, options)
        self.stub = peer_pb2_grpc.KVPeerStub(self._channel)
        self.service_id = ""
        self.agent = ""
        self.epoch = -1
        self.is_self = False  # the peer is this very service (both engines on one node)
        self.boot_id = ""  # the peer's kernel boot id (same as ours: same host)
        self.capabilities: frozenset[str] = frozenset()
        self.lane_agent = ""  # the peer's cross-node lane agent, loaded into ours ("": none)
        self._lock = asyncio.Lock()

    async def call(self, method: str, request: Any, timeout: float) -> Any:
        local = self._me.local
        if self.is_self and local is not None:  # same service: skip the socket round trip
            return await asyncio.wait_for(
                getattr(local, method)(request, _LocalContext()), max(timeout, 0.001)
            )
        try:
            return await getattr(self.stub, method)(request, timeout=max(timeout, 0.001))
        except grpc.RpcError as exc:
            err = peer_error(self.address, exc)
            if isinstance(err, errors.Unavailable):
                self.invalidate()  # lost peer: the next use handshakes again (it may have restarted)
            raise err from None

    async def held_pages(self, bs_id: str, hashes: np.ndarray, timeout: float) -> tuple[np.ndarray, str]:
        """Which of ``hashes`` the peer's buffer set ``bs_id`` holds (a bool per hash), and the
        answering service's id (duplicates.py)."""
        req = peer_pb2.HeldPagesRequest(buffer_set_id=bs_id, hashes=hashes.tolist())
        resp = await self.call("HeldPages", req, timeout)
        return np.asarray(resp.held, dtype=bool), str(resp.service_id)

    async def refresh(self, min_epoch: int = 0, timeout: float = 10.0, service_id: str = "") -> None:
        """Handshake if never done, if the peer's metadata is older than ``min_epoch``, or if
        the peer answered as ``service_id`` and that is not whom we handshook (it restarted on
        the same address: its epochs start over)."""
        async with self._lock:
            if self.knows(min_epoch, service_id):
                return
            await self._me.lane_settled()
            lane = self._me.lane  # the lane came up while this handshake flew: make it again later
            resp = await self.call("Handshake", self._me.request(), timeout)
            if resp.service_id == self._me.service_id:
                # NOTE: NIXL cannot load its own agent; same-node transfers copy locally.
                self.is_self, self.service_id, self.epoch = True, resp.service_id, resp.metadata_epoch
                return
            if resp.service_id != self.service_id and self.agent:
                log.warning("peer restarted", extra={"peer": self.address, "service_id": resp.service_id})
            loop = asyncio.get_running_loop()
            self.agent = await loop.run_in_executor(
                None, self._me.transport.add_peer, resp.agent_name, bytes(resp.agent_metadata)
            )
            self.service_id = resp.service_id
            self.epoch = resp.metadata_epoch
            self.boot_id = resp.boot_id
            self.capabilities = frozenset(resp.capabilities)
            if self._me.lane is not None:
                self.lane_agent = self._me.lane.load_peer(resp.service_id, bytes(resp.lane_agent_metadata))
            if self._me.lane is not lane:
                self.stale()

    def stale(self) -> None:
        """Our side of the handshake changed: the next use handshakes again (the agent stays)."""
        self.epoch = -1

    def knows(self, min_epoch: int, service_id: str = "") -> bool:
        """Our handshake is of this peer (``service_id``, when given) and its metadata at least
        as new as ``min_epoch``."""
        fresh = self.epoch >= min_epoch and (not service_id or service_id == self.service_id)
        return bool(self.agent or self.is_self) and fresh

    def invalidate(self) -> None:
        """Forget the handshake (after a failure); the next use handshakes again."""
        self.agent = ""
        self.epoch = -1
        self.is_self = False

    async def close(self) -> None:
        await self._channel.close()


class PeerDirectory:
    """Cache of peer clients by address."""

    def __init__(self, me: Self, keepalive: KeepalivePolicy, security: ChannelSecurity = PLAIN) -> None:
        self.me = me
        self._options = [
            *channel_options(keepalive=keepalive),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", RETRY_SERVICE_CONFIG),
        ]
        self._security = security
        self._peers: dict[str, PeerClient] = {}

    def get(self, address: str) -> PeerClient:
        peer = self._peers.get(address)
        if peer is None:
            # NOTE: over a Unix socket a peer proves its uid per call (server/local_gate.py)
            sec = dataclasses.replace(self._security, credential_path=credential_path_of(address))
            peer = self._peers[address] = PeerClient(address, self.me, self._options, sec)
        return peer

    def stale(self) -> None:
        """Our handshake metadata changed (the lane came up): each peer's next use handshakes
        again, carrying ours and loading theirs (as after its own epoch moved)."""
        for peer in self._peers.values():
            peer.stale()

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
