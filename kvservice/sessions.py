"""Ownership sessions that survive transport loss.

A client opens a session with the OpenSession stream; resources it creates (buffer sets, leases,
transfers) are tagged with the session id, which later calls carry in ``kvservice-session``
metadata (``require`` validates it). A transport event never releases anything by itself::

    OpenSession ──▶ ATTACHED ──stream breaks──▶ DETACHED ──grace_s passes──▶ released ("lost")
                       ▲                           │
                       └──OpenSession(resume_id)───┘   CloseSession (any state) ──▶ released

Each attach gets a new epoch; a stream that ends only detaches the session if it still holds the
current epoch, so an old stream that the server notices late (a half-open TCP connection) cannot
detach a session that a new stream already resumed. Release runs every hook once; the id is then
remembered (bounded) with its reason, so a late resume or call says why it failed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable

from .errors import NotFound, Unauthenticated
from .identity import Identity

__all__ = ["SESSION_METADATA_KEY", "Session", "SessionRegistry"]

SESSION_METADATA_KEY = "kvservice-session"
_TOMBSTONES = 4096
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Session:
    session_id: str
    client_name: str
    opened_unix_ms: int
    identity: Identity | None = None  # the kernel's word when opened with a local credential
    admin: bool = False  # may see every buffer set (GetStats)


@dataclasses.dataclass
class _Entry:
    session: Session
    epoch: int = 0
    detached_at: float | None = None  # monotonic time the current stream broke; None: attached


class SessionRegistry:
    """Thread-safe sessions with attach/detach epochs, release hooks and counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._released: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._hooks: list[Callable[[str], None]] = []
        self.resumes = 0
        self.lost: collections.Counter[str] = collections.Counter()  # reason -> sessions released

    def on_close(self, hook: Callable[[str], None]) -> None:
        """Register ``hook(session_id)``, run (in registration order) when a session is released."""
        self._hooks.append(hook)

    def open(
        self, client_name: str, identity: Identity | None = None, admin: bool = False
    ) -> tuple[Session, int]:
        """A new attached session and its epoch."""
        s = Session(secrets.token_hex(12), client_name[:128], int(time.time() * 1000), identity, admin)
        with self._lock:
            self._entries[s.session_id] = _Entry(s, epoch=1)
        log.info(
            "session opened",
            extra={
                "session_id": s.session_id,
                "client": s.client_name,
                "uid": getattr(identity, "uid", None),
            },
        )
        return s, 1

    def resume(self, session_id: str) -> tuple[Session, int]:
        """Attach a new stream to an open or detached session; NotFound (with why) otherwise."""
        with self._lock:
            e = self._entries.get(session_id)
            if e is None:
                raise NotFound(f"resume_session_id: {self._why_gone(session_id)}")
            e.epoch += 1
            gap = None if e.detached_at is None else time.monotonic() - e.detached_at
            e.detached_at = None
            self.resumes += 1
        log.info(
            "session resumed",
            extra={"session_id": session_id, "client": e.session.client_name, "detached_s": gap},
        )
        return e.session, e.epoch

    def detach(self, session_id: str, epoch: int) -> bool:
        """The stream of ``epoch`` ended; True when that detached the session (grace starts)."""
        with self._lock:
            e = self._entries.get(session_id)
            if e is None or e.epoch != epoch or e.detached_at is not None:
                return False
            e.detached_at = time.monotonic()
        log.info("session detached; waiting for resume", extra={"session_id": session_id})
        return True

    def take(self, session_id: str, reason: str, epoch: int | None = None) -> Session | None:
        """Remove the session so nothing can resume or use it; the caller then releases it.

        With ``epoch``, only a session still detached since that epoch's stream ended is taken
        (a resume that won the race keeps it). ``reason`` is "closed" for CloseSession or a
        service stop; anything else (e.g. "grace_expired") counts the session as lost.
        Returns None when there was nothing to take (idempotent).
        """
        with self._lock:
            e = self._entries.get(session_id)
            if e is None or (epoch is not None and (e.epoch != epoch or e.detached_at is None)):
                return None
            del self._entries[session_id]
            self._released[session_id] = reason
            while len(self._released) > _TOMBSTONES:
                self._released.popitem(last=False)
            if reason != "closed":
                self.lost[reason] += 1
        return e.session

    def release(self, session: Session, reason: str) -> None:
        """Run every release hook for a session returned by :meth:`take`; logs once."""
        for hook in self._hooks:
            try:
                hook(session.session_id)
            except Exception:  # a failing hook must not keep the others from releasing
                log.exception("session release hook failed", extra={"session_id": session.session_id})
        lost = reason != "closed"
        log.log(
            logging.WARNING if lost else logging.INFO,
            "session lost; its resources are released" if lost else "session closed",
            extra={"session_id": session.session_id, "client": session.client_name, "reason": reason},
        )

    def require(self, session_id: str | None) -> Session:
        if not session_id:
            raise Unauthenticated(
                f"missing '{SESSION_METADATA_KEY}' metadata: open a session with OpenSession first"
            )
        with self._lock:
            e = self._entries.get(session_id)
            if e is None:
                raise Unauthenticated(self._why_gone(session_id))
        return e.session

    def find(self, session_id: str) -> Session | None:
        """The open session, or None (no error: for calls where a session is optional)."""
        with self._lock:
            e = self._entries.get(session_id)
        return e.session if e is not None else None

    def _why_gone(self, session_id: str) -> str:
        reason = self._released.get(session_id)
        if reason is None:
            return f"session {session_id!r} is not open (never opened, or released long ago)"
        return f"session {session_id!r} was released ({reason}); open a new session"

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def listing(self) -> list[tuple[Session, bool]]:
        """Every open session with whether its stream is attached now (the operator view)."""
        with self._lock:
            return [(e.session, e.detached_at is None) for e in self._entries.values()]

    def detached_count(self) -> int:
        with self._lock:
            return sum(e.detached_at is not None for e in self._entries.values())
