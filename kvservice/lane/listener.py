"""The lane socket: ``<uds_path>.lane`` (SOCK_SEQPACKET, the engine socket's file mode).

An engine connects after opening its session and sends a hello naming it. The service admits
the connection only when the kernel's credential (``SO_PEERCRED``) is that session's identity
(the uid its credential proved at OpenSession) and passes ``allowed_uids``; the socket's fd then
belongs to the native thread. Every refusal is answered with its reason and the connection
closed: the engine keeps using gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

from kvservice_client import lane_wire

from ..server.credentials import peer_identity

__all__ = ["LaneListener"]

log = logging.getLogger(__name__)
_HELLO_TIMEOUT_S = 2.0


class LaneListener:
    def __init__(
        self,
        path: str,
        mode: int,
        sessions: Any,
        allowed_uids: frozenset[int] | None,
        native: Any,
        self_addresses: list[str],
        cross: bool = False,
        wait_spin_us: int = 0,
    ) -> None:
        self.path = path
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

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                log.exception("lane accept failed")
                return
            task = asyncio.get_running_loop().create_task(self._greet(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def refusal(self, conn: socket.socket, session_id: str) -> str:
        """Why this connection may not carry ``session_id``'s transfers, or ''."""
        who = peer_identity(conn)
        if self.allowed_uids is not None and who.uid not in self.allowed_uids:
            return f"uid {who.uid} is not in allowed_uids"
        session = self.sessions.find(session_id)
        if session is None:
            return "no such session"
        if session.identity is None:
            return "the session was opened without a local credential (open it over the Unix socket)"
        if session.identity.uid != who.uid:
            return "the session belongs to another uid"
        return ""

    async def _greet(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        loop = asyncio.get_running_loop()
        handed = False
        try:
            data = await asyncio.wait_for(loop.sock_recv(conn, 4096), _HELLO_TIMEOUT_S)
            session_id = lane_wire.parse_hello(data)
            why = self.refusal(conn, session_id)
            if why:
                self.refused += 1
                conn.send(lane_wire.welcome(False, why))
                log.warning("lane refused", extra={"reason": why})
                return
            conn.send(
                lane_wire.welcome(
                    True, self_addresses=self.self_addresses, cross=self.cross, wait_spin_us=self.wait_spin_us
                )
            )
            self.native.add_conn(conn.detach(), session_id)
            handed = True
            self.admitted += 1
        except (asyncio.TimeoutError, ValueError, OSError, UnicodeDecodeError) as exc:
            log.info("lane hello failed: %s", exc)
        finally:
            if not handed:
                conn.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        for task in self._tasks:
            task.cancel()
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
