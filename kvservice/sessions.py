"""Ownership sessions.

A client opens a session with the OpenSession stream; resources it creates (buffer sets, leases,
transfers) are tagged with the session id. When the stream ends, ``close`` runs every release
hook, so nothing an engine owned outlives it. Calls carry the id in ``kvservice-session``
metadata; ``require`` validates it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable

from .errors import Unauthenticated

__all__ = ["SESSION_METADATA_KEY", "Session", "SessionRegistry"]

SESSION_METADATA_KEY = "kvservice-session"
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Session:
    session_id: str
    client_name: str
    opened_unix_ms: int


class SessionRegistry:
    """Thread-safe set of open sessions with release hooks run on close."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._hooks: list[Callable[[str], None]] = []

    def on_close(self, hook: Callable[[str], None]) -> None:
        """Register ``hook(session_id)``, run (in registration order) when a session closes."""
        self._hooks.append(hook)

    def open(self, client_name: str) -> Session:
        s = Session(secrets.token_hex(12), client_name[:128], int(time.time() * 1000))
        with self._lock:
            self._sessions[s.session_id] = s
        log.info("session opened", extra={"session_id": s.session_id, "client": s.client_name})
        return s

    def close(self, session_id: str) -> None:
        """Close and release everything the session owns (idempotent)."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is None:
            return
        for hook in self._hooks:
            try:
                hook(session_id)
            except Exception:  # a failing hook must not keep the others from releasing
                log.exception("session release hook failed", extra={"session_id": session_id})
        log.info("session closed", extra={"session_id": session_id, "client": s.client_name})

    def require(self, session_id: str | None) -> Session:
        if not session_id:
            raise Unauthenticated(
                f"missing '{SESSION_METADATA_KEY}' metadata: open a session with OpenSession first"
            )
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None:
            raise Unauthenticated(f"session {session_id!r} is not open (closed or never opened)")
        return s

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)
