"""The node: one kvservice's domain state (sessions, buffer sets, index, transfers).

The gRPC servicers are thin adapters over this class; everything here speaks domain values and
raises the error tree in ``errors.py``. Here: sessions, buffer registration and drain; the index's
calls (hashing, match, publish, evictions, KV events) are ``prefix`` (``index/calls.py``), the
host tier's ``tier``, the transfers' ``transfers`` (``transfer/engine.py``).

Built once, in dependency order (``server/app.py``; tests: :func:`build_node`)::

    NodeParts.create(config)    sessions, credentials, buffers, index and its calls, tier, notices
        │                       (the listeners' guards read the sessions and credentials)
        ▼  + the address peers reach this service at (known once its listeners are bound)
    TransferEngine(...)         follows the buffers, reads the index, tells the notices
        ▼
    Node(parts, transfers)      what the servicers call
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np
from kvservice_client import Layout

from .buffers import BufferRegistry, BufferSet
from .config import Config
from .errors import PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable
from .identity import CredentialBook
from .index import PrefixIndex
from .index.calls import IndexCalls
from .notices import SessionNotices
from .peers_allow import check_peer_address
from .sessions import Session, SessionRegistry
from .tier import TierCalls
from .transfer.engine import TransferEngine
from .transfer.load import Load
from .transfer.peer_channel import end_inbound_channels

__all__ = ["Node", "NodeParts", "VERSION", "build_node"]

from . import VERSION

log = logging.getLogger(__name__)

# What the aborts of a shutdown may take in all (the drain's, then the sessions' and the transfer
# engine's at close; an abort settles in milliseconds, an in-flight write within the transport's
# settle bound): past it the stop goes on, naming the transfers that did not settle.
SHUTDOWN_SETTLE_S = 10.0


@dataclasses.dataclass(frozen=True)
class Unregistered:
    transfers_aborted: int
    index_entries_dropped: int


@dataclasses.dataclass(frozen=True)
class NodeParts:
    """What a node holds before its transfer engine exists; built first, shared by both."""

    config: Config
    service_id: str
    sessions: SessionRegistry
    credentials: CredentialBook
    buffers: BufferRegistry
    index: PrefixIndex
    prefix: IndexCalls
    tier: TierCalls
    notices: SessionNotices

    @classmethod
    def create(cls, config: Config) -> NodeParts:
        # NOTE: random, not time-based: two services started in the same millisecond must differ
        # (a peer with our own id is treated as ourselves, and it names the NIXL agent).
        service_id = f"{config.listen.service_name or socket.gethostname()}-{secrets.token_hex(6)}"
        buffers, index = BufferRegistry(), PrefixIndex()
        return cls(
            config,
            service_id,
            SessionRegistry(),
            CredentialBook(),
            buffers,
            index,
            IndexCalls(config, index, buffers),  # NOTE: before the engine: its buffer hooks run first
            TierCalls(config, index, buffers),  # the host tier
            SessionNotices(buffers, index),
        )

    def transfer_engine(self, address: str) -> TransferEngine:
        """The transfer engine over these parts, reached by peers at ``address``."""
        return TransferEngine(self.config, self.service_id, address, self.buffers, self.index, self.notices)


def build_node(config: Config, address: str) -> Node:
    """A node with its transfer engine (not started), for callers without listeners (tests)."""
    parts = NodeParts.create(config)
    return Node(parts, parts.transfer_engine(address))


class Node:
    """Domain facade used by the servicers. Thread-safe where its parts are."""

    def __init__(self, parts: NodeParts, transfers: TransferEngine) -> None:
        self.config = parts.config
        self.service_id = parts.service_id
        self.started = time.monotonic()
        self.sessions = parts.sessions
        self.credentials = parts.credentials
        self.buffers = parts.buffers
        self.index = parts.index
        self.prefix = parts.prefix
        self.tier = parts.tier
        self.notices = parts.notices
        self.transfers = transfers
        self._session_timers: set[asyncio.Task[None]] = set()
        self.draining = False
        self.shutdown_settle_s = SHUTDOWN_SETTLE_S
        self._settle_by: float | None = None  # the shutdown's bound, from its first bounded step
        self.sessions.on_close(self._release_session)

    def check_accepting(self, rpc: str) -> None:
        """A new transfer (``rpc``: ExpectDelta, SendDelta) is refused while the service drains."""
        if self.draining:
            raise Unavailable(f"{rpc}: the service is draining for shutdown; retry on another instance")

    # -- sessions --------------------------------------------------------------------------
    def open_session(
        self, client_name: str, resume_session_id: str = "", credential: str = "", local: bool = False
    ) -> tuple[Session, int]:
        """Open a session (identified when ``credential`` came from the credential socket), or
        attach a new stream to ``resume_session_id``; returns (session, epoch). ``local``: the
        call came over the Unix socket (``allowed_uids`` applies)."""
        if resume_session_id:
            return self.sessions.resume(resume_session_id)
        identity = None
        if credential:
            identity = self.credentials.take(credential)
            if identity is None:
                raise Unauthenticated("kvservice-credential: unknown or expired (fetch a new one)")
        allowed = self.config.security.allowed_uid_set
        if allowed is not None and local and identity is None:
            raise PermissionDenied(
                "allowed_uids: sessions over the Unix socket must be identified (present a "
                "kvservice-credential from <socket>.cred; the SDK does)"
            )
        if allowed is not None and identity is not None and identity.uid not in allowed:
            raise PermissionDenied(f"allowed_uids: uid {identity.uid} may not use this service")
        admin = identity is not None and identity.uid in self.config.security.admin_uid_set
        return self.sessions.open(client_name, identity, admin)

    def check_peer_address(self, address: str) -> None:
        """SendDelta may aim only at allowlisted peers (``peer_allowlist``; empty: any)."""
        check_peer_address(address, self.config.security.peer_allowlist_entries)

    def session_stream_ended(self, session_id: str, epoch: int) -> None:
        """The session stream of ``epoch`` broke: release only if no resume comes within the grace.

        Runs as a task of its own, not in the stream's (cancelled) handler.
        """
        if not self.sessions.detach(session_id, epoch):
            return

        async def expire() -> None:
            await asyncio.sleep(self.config.listen.session_grace_s)
            await self.close_session(session_id, "grace_expired", epoch)

        task = asyncio.get_running_loop().create_task(expire())
        self._session_timers.add(task)
        task.add_done_callback(self._session_timers.discard)

    async def close_session(
        self, session_id: str, reason: str = "closed", epoch: int | None = None, bounded: bool = False
    ) -> bool:
        """End a session: abort its transfers (settled), then release its leases and buffers.

        With ``epoch``: only if still detached since that stream ended (see SessionRegistry.take).
        ``bounded`` (shutdown): the aborts within the shutdown's bound (``_settled``).
        """
        session = self.sessions.take(session_id, reason, epoch)
        if session is None:
            return False
        ending = self.transfers.release_session(session_id)
        await (self._settled(ending, f"closing session {session_id}") if bounded else ending)
        self.sessions.release(session, reason)
        return True

    def _release_session(self, session_id: str) -> None:
        self.notices.drop(session_id)
        self.index.release_owner(session_id)
        self.tier.tier.release_owner(session_id)
        self.buffers.release_session(session_id)

    # -- buffers ---------------------------------------------------------------------------
    def register_buffers(
        self,
        session: Session,
        engine_id: str,
        layout: Layout,
        k_regions: Sequence[Any],
        v_regions: Sequence[Any],
        aux_regions: Sequence[Any],
        inbound_max_transfers: int = 0,
        inbound_max_bytes: int = 0,
    ) -> BufferSet:
        """Only an identified local caller registers memory, and shm only if it owns it.
        ``inbound_max_*`` (0: the service default) is the buffer set's inbound budget."""
        if session.identity is None:
            raise PermissionDenied(
                "RegisterBuffers: memory is registered only by an identified local caller; open the "
                "session over the service's Unix socket (the SDK fetches a credential from <socket>.cred)"
            )
        cap = self.config.limits.max_buffer_sets_per_session
        if self.buffers.owned_by(session.session_id) >= cap:
            raise ResourceExhausted(
                f"max_buffer_sets_per_session: this session already holds {cap} buffer sets; "
                "unregister one first"
            )
        bs = self.buffers.register(
            session.session_id, engine_id, layout, k_regions, v_regions, aux_regions, session.identity.uid
        )
        self.transfers.load.set_budget(bs.buffer_set_id, inbound_max_transfers, inbound_max_bytes)
        return bs

    def load_of(self, buffer_set_id: str) -> Load:
        """Transfer load of a buffer set; zeros for a presence-only (KV-event) set."""
        return self.transfers.load.load(buffer_set_id)

    async def unregister_buffers(self, session_id: str, buffer_set_id: str) -> Unregistered:
        self.buffers.get(buffer_set_id, session_id)  # ownership check before anything changes
        aborted = await self.transfers.abort_buffer_set(buffer_set_id)
        dropped = self.index.remove_buffer_set(buffer_set_id)
        self.buffers.unregister(buffer_set_id, session_id)
        return Unregistered(aborted, dropped)

    async def suggest_evictions(
        self, session_id: str, buffer_set_id: str, max_pages: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pages to evict first (``IndexCalls.suggest_evictions``), the transfer engine's
        duplicate marks checked with their receivers first."""
        return await self.prefix.suggest_evictions(
            session_id, buffer_set_id, max_pages, self.transfers.duplicates
        )

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def uptime_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000)

    async def drain(self, grace_s: float) -> None:
        """Refuse new transfers, wait up to ``grace_s`` for in-flight ones to end, then end the
        peer channels of sending services (nothing is left for them to carry)."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.transfers.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = self.transfers.in_flight()
        if left:
            log.warning("grace period over; aborting in-flight transfers", extra={"count": left})
            await self._settled(
                self.transfers.abort_all("service shutting down"), "aborting in-flight transfers"
            )
        await end_inbound_channels(self.transfers)

    async def _settled(self, step: Awaitable[Any], what: str) -> None:
        """A shutdown step that aborts transfers, within what is left of the shutdown's bound
        (``shutdown_settle_s`` from the first such step; at least 0.5 s each). Past it the step
        is cancelled and the stop goes on, saying which transfers did not settle: a shutdown
        never hangs on one (the service's state goes with the process)."""
        if self._settle_by is None:
            self._settle_by = time.monotonic() + self.shutdown_settle_s
        task = asyncio.ensure_future(step)
        done, _ = await asyncio.wait({task}, timeout=max(self._settle_by - time.monotonic(), 0.5))
        if task in done:
            task.result()
            return
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        live = self.transfers.table.live()
        stuck = sorted({f"{r.transfer_id} ({r.role.lower()})" for r in live})
        log.warning(
            "%s: transfers did not settle within the shutdown bound (%.1fs); stopping anyway: %s",
            what,
            self.shutdown_settle_s,
            ", ".join(stuck[:20]) + (f" and {len(stuck) - 20} more" if len(stuck) > 20 else ""),
            extra={"count": len(stuck)},
        )

    async def close(self) -> None:
        self.prefix.close()
        self.tier.close()
        for task in list(self._session_timers):
            task.cancel()
        for sid in self.sessions.ids():
            await self.close_session(sid, bounded=True)
        await self.transfers.close(self._settled)
