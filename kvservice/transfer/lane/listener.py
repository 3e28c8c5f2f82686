"""The lane socket: ``<uds_path>.lane`` (SOCK_SEQPACKET, the engine socket's file mode).

An engine connects after opening its session and sends a hello naming it. The service admits
the connection only when the kernel's credential (``SO_PEERCRED``) is that session's identity
(the uid its credential proved at OpenSession) and passes ``allowed_uids``; the socket's fd then
belongs to the native thread. Every refusal is answered with its reason and the connection
closed: the engine keeps using gRPC.

Limits that hold whatever another process does (one service serves every engine of a node):

* at most ``MAX_PENDING`` connections waiting for their hello (each for ``_HELLO_TIMEOUT_S``);
  past it a new connection is closed at once, unread;
* at most ``MAX_CONNS_PER_SESSION`` admitted connections per session;
* a hello is bounded (``lane_wire.MAX_HELLO``) and anything unparseable is a refusal;
* ``accept`` failing for want of fds or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) stops listening
  for a backoff (doubling from 10 ms to 1 s) instead of spinning on a readable socket, with one
  log line per ``_LOG_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from kvservice_client import lane_wire

from ...identity import socket_identity

if TYPE_CHECKING:
    from ...sessions import SessionRegistry
    from ._native_api import NativeLane

__all__ = ["MAX_CONNS_PER_SESSION", "MAX_PENDING", "LaneListener"]

log = logging.getLogger(__name__)
_HELLO_TIMEOUT_S = 2.0
MAX_PENDING = 64  # connections not yet admitted (no hello read), over every peer
MAX_CONNS_PER_SESSION = 16  # an engine's SDK opens one per Client
_BACKOFF_S = (0.01, 1.0)  # accept's backoff when the process is out of fds or memory
_LOG_EVERY_S = 10.0
_OUT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class LaneListener:
    def __init__(
        self,
        path: str,
        mode: int,
        sessions: SessionRegistry,
        allowed_uids: frozenset[int] | None,
        native: NativeLane,
        self_addresses: list[str],
        cross: bool = False,
        wait_spin_us: int = 0,
        calls: tuple[str, ...] = (),
    ) -> None:
        self.path = path
        self.calls = calls
        self.wait_spin_us = wait_spin_us
        self.sessions = sessions
        self.allowed_uids = allowed_uids
        self.native = native
        self.self_addresses = self_addresses
        self.cross = cross
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        os.chmod(path, mode)
        self.sock.listen(128)
        self.sock.setblocking(False)
        self._tasks: set[asyncio.Task[None]] = set()
        self.admitted = 0
        self.refused = 0
        self.shed = 0  # connections closed unread (MAX_PENDING)
        self.backoffs = 0  # times accept ran out of fds or memory
        self._backoff = 0.0
        self._retry: asyncio.TimerHandle | None = None
        self._logged: dict[str, float] = {}

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._accept)

    def _log_limited(self, what: str, msg: str, *args: object) -> None:
        """``msg`` at WARNING, at most once per ``_LOG_EVERY_S`` for each ``what``."""
        now = time.monotonic()
        if now - self._logged.get(what, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[what] = now
            log.warning(msg, *args)

    def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF:
                    self._log_limited("accept", "lane accept failed: %s", exc)
                    return
                # the socket stays readable: stop listening for a while rather than spin on it
                self.backoffs += 1
                self._backoff = min(max(self._backoff * 2, _BACKOFF_S[0]), _BACKOFF_S[1])
                self._log_limited(
                    "fds", "lane accept: %s; retrying in %.0f ms", exc.strerror, self._backoff * 1e3
                )
                loop.remove_reader(self.sock.fileno())
                self._retry = loop.call_later(self._backoff, self._resume)
                return
            self._backoff = 0.0
            if len(self._tasks) >= MAX_PENDING:
                self.shed += 1
                self._log_limited(
                    "pending", "lane: %d connections wait for their hello; closing new ones", MAX_PENDING
                )
                conn.close()
                continue
            task = loop.create_task(self._greet(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _resume(self) -> None:
        self._retry = None
        with contextlib.suppress(OSError, ValueError):
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self._accept)

    def refusal(self, conn: socket.socket, session_id: str) -> str:
        """Why this connection may not carry ``session_id``'s transfers, or ''."""
        who = socket_identity(conn)
        if self.allowed_uids is not None and who.uid not in self.allowed_uids:
            return f"uid {who.uid} is not in allowed_uids"
        session = self.sessions.find(session_id)
        if session is None:
            return "no such session"
        if session.identity is None:
            return "the session was opened without a local credential (open it over the Unix socket)"
        if session.identity.uid != who.uid:
            return "the session belongs to another uid"
        if self.native.conns_of(session_id) >= MAX_CONNS_PER_SESSION:
            return f"the session has {MAX_CONNS_PER_SESSION} lane connections already"
        return ""

    async def _greet(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        loop = asyncio.get_running_loop()
        handed = False
        try:
            data = await asyncio.wait_for(loop.sock_recv(conn, lane_wire.MAX_HELLO + 1), _HELLO_TIMEOUT_S)
            try:
                session_id = lane_wire.parse_hello(data)
            except ValueError as exc:
                self.refused += 1
                with contextlib.suppress(OSError):
                    conn.send(lane_wire.welcome(False, str(exc)))
                self._log_limited("hello", "lane refused: %s", exc)
                return
            why = self.refusal(conn, session_id)
            if why:
                self.refused += 1
                conn.send(lane_wire.welcome(False, why))
                self._log_limited("refused", "lane refused: %s", why)
                return
            conn.send(
                lane_wire.welcome(
                    True,
                    self_addresses=self.self_addresses,
                    cross=self.cross,
                    wait_spin_us=self.wait_spin_us,
                    calls=self.calls,
                )
            )
            self.native.add_conn(conn.detach(), session_id)
            handed = True
            self.admitted += 1
        except (asyncio.TimeoutError, OSError) as exc:
            log.debug("lane hello failed: %s", exc)
        except Exception as exc:  # NOTE: never a task exception left unretrieved (another process's bytes)
            self._log_limited("greet", "lane hello failed: %s: %s", type(exc).__name__, exc)
        finally:
            if not handed:
                conn.close()

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        for task in self._tasks:
            task.cancel()
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
