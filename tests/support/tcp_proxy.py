"""A TCP proxy for tests that can cut every connection (a reset network), refuse new ones, or
freeze (a silent network: nothing passes, nothing is closed)."""

from __future__ import annotations

import socket
import threading
import time

__all__ = ["TcpProxy"]


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``upstream`` ("host:port") on threads."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._accepting = True
        self._closed = False
        self.frozen = threading.Event()
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self, refuse: bool = False) -> None:
        """Reset every open connection; with ``refuse``, also reset new ones until ``allow()``."""
        with self._lock:
            self._accepting = not refuse
            conns, self._conns = self._conns, []
        for c in conns:
            _reset(c)

    def freeze(self) -> None:
        """Stop forwarding bytes in both directions and refuse new connections; close nothing."""
        with self._lock:
            self._accepting = False
        self.frozen.set()

    def allow(self) -> None:
        with self._lock:
            self._accepting = True

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                accepting = self._accepting
            if not accepting:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b, self.frozen), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket, frozen: threading.Event) -> None:
    try:
        while True:
            if frozen.is_set():  # a silent network: bytes stay in the kernel, nothing closes
                time.sleep(0.05)
                continue
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _reset(dst)


def _reset(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.shutdown(socket.SHUT_RDWR)  # wakes the pump thread blocked in recv
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
