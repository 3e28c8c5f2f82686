"""The node: one kvservice's domain state (sessions, buffer sets, index, transfers).

The gRPC servicers are thin adapters over this class; everything here speaks domain values and
raises the error tree in ``errors.py``. Capabilities that later subsystems provide (prefix index,
transfer engine) are attached with ``attach_*``; until then their calls raise Unimplemented with
a message saying what is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from typing import Any

from kvservice_client import Layout

from .buffers import BufferRegistry, BufferSet
from .config import Config
from .errors import Unavailable, Unimplemented
from .sessions import Session, SessionRegistry

__all__ = ["Node", "VERSION"]

VERSION = "0.1.0"
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Unregistered:
    transfers_aborted: int
    index_entries_dropped: int


class Node:
    """Domain facade used by the servicers. Thread-safe where its parts are."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.service_id = f"{config.service_name or socket.gethostname()}-{int(time.time() * 1000) % 10**9}"
        self.started = time.monotonic()
        self.sessions = SessionRegistry()
        self.buffers = BufferRegistry()
        self.index: Any = None
        self.transfers: Any = None
        self.draining = False
        self.sessions.on_close(self._release_session)

    # -- capabilities attached by later subsystems ----------------------------------------
    def require_index(self, rpc: str) -> Any:
        if self.index is None:
            raise Unimplemented(f"{rpc}: the prefix index is not part of this build yet")
        return self.index

    def require_transfers(self, rpc: str) -> Any:
        if self.transfers is None:
            raise Unimplemented(f"{rpc}: the transfer engine (NIXL data path) is not part of this build yet")
        if self.draining and rpc in ("ExpectDelta", "SendDelta"):
            raise Unavailable(f"{rpc}: the service is draining for shutdown; retry on another instance")
        return self.transfers

    # -- sessions --------------------------------------------------------------------------
    def open_session(self, client_name: str) -> Session:
        return self.sessions.open(client_name)

    async def close_session(self, session_id: str) -> None:
        """End a session: abort its transfers (settled), then release its leases and buffers."""
        if self.transfers is not None:
            await self.transfers.release_session(session_id)
        self.sessions.close(session_id)

    def _release_session(self, session_id: str) -> None:
        if self.index is not None:
            self.index.release_owner(session_id)
        self.buffers.release_session(session_id)

    # -- buffers ---------------------------------------------------------------------------
    def register_buffers(
        self,
        session_id: str,
        engine_id: str,
        layout: Layout,
        k_regions: Any,
        v_regions: Any,
        aux_regions: Any,
    ) -> BufferSet:
        return self.buffers.register(session_id, engine_id, layout, k_regions, v_regions, aux_regions)

    async def unregister_buffers(self, session_id: str, buffer_set_id: str) -> Unregistered:
        self.buffers.get(buffer_set_id, session_id)  # ownership check before anything changes
        aborted = await self.transfers.abort_buffer_set(buffer_set_id) if self.transfers is not None else 0
        dropped = self.index.remove_buffer_set(buffer_set_id) if self.index is not None else 0
        self.buffers.unregister(buffer_set_id, session_id)
        return Unregistered(aborted, dropped)

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def uptime_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000)

    async def drain(self, grace_s: float) -> None:
        """Refuse new transfers and wait up to ``grace_s`` for in-flight ones to end."""
        self.draining = True
        if self.transfers is None:
            return
        deadline = time.monotonic() + grace_s
        while self.transfers.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = self.transfers.in_flight()
        if left:
            log.warning("grace period over; aborting in-flight transfers", extra={"count": left})
            await self.transfers.abort_all("service shutting down")

    async def close(self) -> None:
        for sid in self.sessions.ids():
            await self.close_session(sid)
        if self.transfers is not None:
            await self.transfers.close()
