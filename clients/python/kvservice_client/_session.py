"""The client side of an ownership session: open, hold, resume, or report it lost.

A session lives on the service, not in a connection. Its stream breaking (GOAWAY, reset, a
restarted proxy) only detaches it there; this keeper reopens the stream with the same id,
backing off, until the service's grace period (``SessionEvent.grace_ms``) runs out::

    idle ─first use─▶ opening ─▶ ready ─stream breaks─▶ resuming ─▶ ready
                        │                                  │
                        └▶ failed (Unavailable)            └▶ lost (SessionLost: NOT_FOUND from
                                                              the service, or unreachable past
                                                              the grace period)

Owned calls wait while the keeper is opening or resuming (within their own timeout) and raise
SessionLost once it is lost. ``Owned`` records what the client created in the session, so the
loss names it and buffer sets can be registered again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from ._errors import KVClientError, NotFound, SessionLost, Unavailable, map_rpc_error
from ._local_identity import CREDENTIAL_METADATA_KEY
from ._proto import kvservice_pb2 as pb
from ._requests import SESSION_METADATA_KEY

__all__ = [
    "CREDENTIAL_METADATA_KEY",
    "Owned",
    "RegisterArgs",
    "SessionKeeper",
    "find_credential_path",
    "fetch_credential",
]

log = logging.getLogger("kvservice_client")
GRACE_MARGIN_S = 0.5  # the service may notice the break a little after us
BACKOFF_S = (0.05, 1.0)  # first and largest pause between resume attempts


def find_credential_path(target: str, explicit: str | None) -> str | None:
    """Where to fetch a local credential: ``explicit``, else ``<socket>.cred`` for unix targets."""
    if explicit is not None:
        return explicit or None
    if target.startswith("unix:"):
        return target.removeprefix("unix:").removeprefix("//") + ".cred"
    return None


def fetch_credential(path: str | None, timeout: float = 10.0) -> str:
    """One single-use credential from the service's credential socket ('' when there is none).

    The service reads this process's uid/pid from the kernel (SO_PEERCRED); presenting the
    credential on OpenSession gives the session that identity (needed to register memory).
    """
    if not path:
        return ""
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(64)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return ""  # no credential socket (TCP-only service, older service): an anonymous session
    return data.decode().strip()


@dataclasses.dataclass(frozen=True)
class RegisterArgs:
    """What RegisterBuffers was called with, kept to register the same regions again."""

    layout: Any
    k_regions: tuple[Any, ...]
    v_regions: tuple[Any, ...]
    aux: tuple[Any, ...]
    engine_id: str
    inbound_max_transfers: int = 0
    inbound_max_bytes: int = 0


class Owned:
    """What this client created in its current session (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.buffer_sets: dict[str, RegisterArgs] = {}
        self._leases: dict[str, float] = {}  # lease id -> expiry (time.time())
        self._transfers: set[str] = set()

    def add_buffer_set(self, buffer_set_id: str, args: RegisterArgs) -> None:
        with self._lock:
            self.buffer_sets[buffer_set_id] = args

    def drop_buffer_set(self, buffer_set_id: str) -> None:
        with self._lock:
            self.buffer_sets.pop(buffer_set_id, None)

    def take_buffer_sets(self) -> dict[str, RegisterArgs]:
        """Forget every buffer set (a lost session's) and return what registered them."""
        with self._lock:
            taken, self.buffer_sets = self.buffer_sets, {}
        return taken

    def add_lease(self, lease_id: str, expires_unix_ms: int) -> None:
        if lease_id:
            with self._lock:
                self._leases[lease_id] = expires_unix_ms / 1000

    def drop_lease(self, lease_id: str) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    def add_transfer(self, transfer_id: str) -> None:
        with self._lock:
            self._transfers.add(transfer_id)

    def observe(self, statuses: Any) -> None:
        """Forget transfers seen in a terminal state."""
        with self._lock:
            for st in statuses:
                if st.terminal:
                    self._transfers.discard(st.transfer_id)

    def lost(self, session_id: str, reason: str) -> SessionLost:
        """The SessionLost naming everything still owned; leases and transfers are forgotten."""
        now = time.time()
        with self._lock:
            err = SessionLost(
                session_id,
                reason,
                tuple(self.buffer_sets),
                tuple(lid for lid, exp in self._leases.items() if exp > now),
                tuple(sorted(self._transfers)),
            )
            self._leases.clear()
            self._transfers.clear()
        return err


class SessionKeeper:
    """Holds the session stream on a daemon thread, for both clients (``stub``: a blocking
    KVService stub; the asyncio client keeps a small blocking channel for it).

    Why a thread for the asyncio client too: the stream is long-lived, its resume backs off and
    its first read has a deadline; one implementation of those rules is worth a thread and a
    connection per client. Calls never wait on it once the session is open (``ready_id``)."""

    def __init__(
        self,
        stub: Any,
        client_name: str,
        target: str,
        owned: Owned,
        on_lost: Callable[[SessionLost], None] | None = None,
        credential_path: str | None = None,
    ) -> None:
        self._credential_path = credential_path
        self._stub = stub
        self._client_name = client_name
        self._target = target
        self._owned = owned
        self._on_lost = on_lost
        # Told of every later event on the stream (P/D duplicate notices), on the stream thread.
        self.listeners: list[Callable[[Any], None]] = []
        self._cond = threading.Condition()
        self._state = "idle"
        self._error: KVClientError | None = None
        self._call: Any = None
        self.session_id = ""
        self.grace_s = 0.0
        self.peer_address = ""  # the service as other kvservices reach it ("" from older services)
        self.resumes = 0

    def current(self, timeout: float) -> str:
        """The session id: opens the session on first use, waits out a resume, raises if lost."""
        with self._cond:
            if self._state in ("idle", "failed"):
                self._state, self._error = "opening", None
                deadline = time.monotonic() + timeout
                threading.Thread(
                    target=self._run, args=(deadline,), name="kvservice-session", daemon=True
                ).start()
            if not self._cond.wait_for(lambda: self._state not in ("opening", "resuming"), timeout):
                raise Unavailable(f"no session from {self._target} within {timeout}s ({self._state})")
            if self._state == "ready":
                return self.session_id
            assert self._error is not None
            raise self._error

    def ready_id(self) -> str:
        """The session id while the session is open, else '': no lock (the send path's fast
        check; a session lost meanwhile fails the lane's SEND, which then goes over gRPC)."""
        return self.session_id if self._state == "ready" else ""

    def peek(self) -> str:
        """The session id if the session is open now, else '' (never opens one)."""
        with self._cond:
            return self.session_id if self._state == "ready" else ""

    def mark_lost(self, reason: str) -> SessionLost:
        """The service says the session is gone (a call was refused with 'was released')."""
        with self._cond:
            if self._state == "lost" and isinstance(self._error, SessionLost):
                return self._error
            self._cancel()
            return self._lose(reason)

    def reset(self) -> None:
        """Forget a lost session so the next use opens a new one."""
        with self._cond:
            self._cancel()
            self._state, self._error, self.session_id = "idle", None, ""

    def close(self, timeout: float) -> None:
        """End the session on the service (CloseSession, at most ``timeout``) and stop the thread."""
        with self._cond:
            ready, sid = self._state == "ready", self.session_id
            self._state = "closed"
            self._error = Unavailable("the client is closed")
            self._cond.notify_all()
        if ready:
            try:
                md = ((SESSION_METADATA_KEY, sid),)
                self._stub.CloseSession(pb.CloseSessionRequest(), timeout=timeout, metadata=md)
            except grpc.RpcError:
                pass  # the stream's end releases it after the grace period anyway
        with self._cond:
            self._cancel()

    # -- the thread ------------------------------------------------------------------------
    def _run(self, deadline: float) -> None:
        try:
            call = self._open("", deadline)
        except KVClientError as exc:
            with self._cond:
                if self._state == "opening":
                    self._state, self._error = "failed", exc
                    self._cond.notify_all()
            return
        while call is not None:
            try:
                for event in call:
                    for listener in list(self.listeners):
                        try:
                            listener(event)
                        except Exception:  # a listener's bug must not end the session
                            log.exception("session event listener failed")
            except grpc.RpcError:
                pass
            call = self._resume(call)

    def _open(self, resume_id: str, deadline: float) -> Any:
        """Open (or resume) the stream and read its first event by ``deadline``; returns the call."""
        req = pb.OpenSessionRequest(client_name=self._client_name, resume_session_id=resume_id)
        metadata = () if resume_id else ((CREDENTIAL_METADATA_KEY, fetch_credential(self._credential_path)),)
        # NOTE: waits for the channel to (re)connect, bounded by the deadline (the caller's timeout,
        # or the grace period when resuming) instead of failing at the first refused connection.
        call = self._stub.OpenSession(req, wait_for_ready=True, metadata=tuple(m for m in metadata if m[1]))
        timer = threading.Timer(max(deadline - time.monotonic(), 0), call.cancel)
        with self._cond:
            if self._state == "closed":
                call.cancel()
                raise Unavailable("the client is closed")
            self._call = call
        timer.start()
        try:
            first = next(call)
        except StopIteration:
            raise Unavailable("session stream ended before it started") from None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                raise Unavailable(f"{self._target} did not answer in time") from None
            raise map_rpc_error(exc) from None
        finally:
            timer.cancel()
        with self._cond:
            if self._state == "closed":
                call.cancel()
                raise Unavailable("the client is closed")
            self.session_id, self.grace_s = first.session_id, first.grace_ms / 1000
            self.peer_address = first.peer_address
            if first.resumed:
                self.resumes += 1
            self._state = "ready"
            self._cond.notify_all()
        return call

    def _resume(self, broken: Any) -> Any:
        """After ``broken`` ended: reopen with the same id until the grace deadline; None when done."""
        with self._cond:
            if self._state != "ready" or self._call is not broken:
                return None  # closed, reset or marked lost: the stream was ended on purpose
            self._state = "resuming"
            sid = self.session_id
        log.warning("kvservice session stream broke; resuming", extra={"session_id": sid})
        deadline = time.monotonic() + self.grace_s + GRACE_MARGIN_S
        pause, last = BACKOFF_S[0], "no attempt"
        while time.monotonic() < deadline:
            try:
                call = self._open(sid, deadline)
                log.info("kvservice session resumed", extra={"session_id": sid})
                return call
            except NotFound as exc:
                last = exc.message
                break
            except KVClientError as exc:
                last = exc.message
                if self._state == "closed":
                    return None
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(pause * 2, BACKOFF_S[1])
        with self._cond:
            if self._state == "resuming":
                self._lose(f"not resumed within the {self.grace_s:g}s grace period: {last}")
        return None

    def _lose(self, reason: str) -> SessionLost:
        err = self._owned.lost(self.session_id, reason)
        self._state, self._error = "lost", err
        self._cond.notify_all()
        log.error("kvservice session lost", extra={"session_id": self.session_id, "reason": reason})
        if self._on_lost is not None:
            threading.Thread(target=self._on_lost, args=(err,), daemon=True).start()
        return err

    def _cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
