"""The node: one kvservice's domain state (sessions, buffer sets, index, transfers).

The gRPC servicers are thin adapters over this class; everything here speaks domain values and
raises the error tree in ``errors.py``. Here: sessions, buffer registration and drain; the index's
calls (hashing, match, publish, evictions, KV events) are ``prefix`` (``index/calls.py``). The
transfer engine is attached as ``transfers``; until then its calls raise Unimplemented with a
message saying what is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import time
from collections.abc import Awaitable
from typing import Any

from kvservice_client import Layout

from .buffers import BufferRegistry, BufferSet
from .config import Config
from .errors import (
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from .identity import CredentialBook
from .index import PrefixIndex
from .index.calls import IndexCalls
from .latest import LatestQueue
from .peers_allow import peer_allowed
from .sessions import Session, SessionRegistry
from .tier import TierCalls

__all__ = ["Node", "VERSION"]

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


class Node:
    """Domain facade used by the servicers. Thread-safe where its parts are."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # NOTE: random, not time-based: two services started in the same millisecond must differ
        # (a peer with our own id is treated as ourselves, and it names the NIXL agent).
        self.service_id = f"{config.listen.service_name or socket.gethostname()}-{secrets.token_hex(6)}"
        self.started = time.monotonic()
        self.sessions = SessionRegistry()
        self.credentials = CredentialBook()
        self._session_timers: set[asyncio.Task[None]] = set()
        self.buffers = BufferRegistry()
        self.index = PrefixIndex()
        self.transfers: Any = None
        self.prefix = IndexCalls(config, self.index, self.buffers, lambda: self.transfers)
        self.tier = TierCalls(config, self.index, self.buffers)  # the host tier (issue 49)
        self.draining = False
        self.shutdown_settle_s = SHUTDOWN_SETTLE_S
        self._settle_by: float | None = None  # the shutdown's bound, from its first bounded step
        # session id -> its stream's pending duplicate counts, per buffer set (newest only)
        self._notices: dict[str, LatestQueue[str, int]] = {}
        self.sessions.on_close(self._release_session)

    # -- capabilities attached by later subsystems ----------------------------------------
    def require_transfers(self, rpc: str) -> Any:
        if self.transfers is None:
            raise Unimplemented(f"{rpc}: the transfer engine (NIXL data path) is not part of this build yet")
        if self.draining and rpc in ("ExpectDelta", "SendDelta"):
            raise Unavailable(f"{rpc}: the service is draining for shutdown; retry on another instance")
        return self.transfers

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
        allow = self.config.security.peer_allowlist_entries
        if allow and not peer_allowed(address, allow):
            raise PermissionDenied(f"peer_address: {address!r} is not in this service's peer_allowlist")

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
        if self.transfers is not None:
            ending = self.transfers.release_session(session_id)
            await (self._settled(ending, f"closing session {session_id}") if bounded else ending)
        self.sessions.release(session, reason)
        return True

    def session_notices(self, session_id: str) -> LatestQueue[str, int]:
        """The pending notices of a session's stream (a resumed stream takes over the same)."""
        return self._notices.setdefault(session_id, LatestQueue())

    def notify_duplicates(self, buffer_set_id: str) -> None:
        """Tell the owner session of ``buffer_set_id`` how many of its pages are P/D duplicates
        now (coalesced: a slow stream gets the latest count once)."""
        try:
            bs = self.buffers.get(buffer_set_id)
        except NotFound:
            return
        box = self._notices.get(bs.session_id)
        if box is not None:  # NOTE: on the event loop (the transfer engine's callbacks run there)
            box.put(buffer_set_id, self.index.duplicated_pages(buffer_set_id))

    def _release_session(self, session_id: str) -> None:
        self._notices.pop(session_id, None)
        self.index.release_owner(session_id)
        self.tier.tier.release_owner(session_id)
        self.buffers.release_session(session_id)

    # -- buffers ---------------------------------------------------------------------------
    def register_buffers(
        self,
        session: Session,
        engine_id: str,
        layout: Layout,
        k_regions: Any,
        v_regions: Any,
        aux_regions: Any,
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
        if self.transfers is not None:
            self.transfers.load.set_budget(bs.buffer_set_id, inbound_max_transfers, inbound_max_bytes)
        return bs

    def load_of(self, buffer_set_id: str) -> Any:
        """Transfer load of a buffer set (``transfer.load.Load``); zeros without a transfer engine
        or for a presence-only (KV-event) set."""
        from .transfer.load import EMPTY_LOAD

        if self.transfers is None:
            return EMPTY_LOAD
        return self.transfers.load.load(buffer_set_id)

    async def unregister_buffers(self, session_id: str, buffer_set_id: str) -> Unregistered:
        self.buffers.get(buffer_set_id, session_id)  # ownership check before anything changes
        aborted = await self.transfers.abort_buffer_set(buffer_set_id) if self.transfers is not None else 0
        dropped = self.index.remove_buffer_set(buffer_set_id)
        self.buffers.unregister(buffer_set_id, session_id)
        return Unregistered(aborted, dropped)

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def uptime_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000)

    async def drain(self, grace_s: float) -> None:
        """Refuse new transfers, wait up to ``grace_s`` for in-flight ones to end, then end the
        peer channels of sending services (nothing is left for them to carry)."""
        self.draining = True
        if self.transfers is None:
            return
        deadline = time.monotonic() + grace_s
        while self.transfers.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = self.transfers.in_flight()
        if left:
            log.warning("grace period over; aborting in-flight transfers", extra={"count": left})
            await self._settled(
                self.transfers.abort_all("service shutting down"), "aborting in-flight transfers"
            )
        from .transfer.peer_channel import end_inbound_channels

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
        live = self.transfers.table.live() if self.transfers is not None else []
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
        if self.transfers is not None:
            await self.transfers.close(self._settled)
