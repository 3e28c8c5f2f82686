"""A peer whose first connections close before the TLS or HTTP/2 handshake ends (as a peer's
listener does while it restarts, or under a full accept queue): the calls to it that change
nothing (Handshake, HeldPages) are tried again by gRPC's retry policy, so the transfer ends DONE;
a peer that never accepts still fails the transfer UNAVAILABLE with its address, within the
deadline."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.nodes import Nodes

pytest.importorskip("nixl")


class DroppingProxy:
    """A TCP proxy to ``target`` that closes its first ``drop`` connections at accept (-1: all)."""

    def __init__(self, target: str, drop: int) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host.strip("[]"), int(port))
        self._drop = drop
        self.dropped = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if self._drop < 0 or self.dropped < self._drop:
                self.dropped += 1
                conn.close()
                continue
            up = socket.create_connection(self._target)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._sock.close()


@pytest.fixture
def nodes(make_server: Any, tmp_path: Any) -> Iterator[Nodes]:
    n = Nodes(make_server, str(tmp_path), cross_lane=False, auth="insecure")
    try:
        yield n
    finally:
        n.close()


def test_a_peer_that_drops_its_first_connections_still_gets_the_transfer(nodes: Nodes) -> None:
    n = nodes
    proxy = DroppingProxy(n.peer, drop=2)
    try:
        n.peer = proxy.address
        r, s = n.move("t-retry", [1, 2, 3], [4, 5, 6])
        assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
        assert proxy.dropped == 2
        assert n.b.pages([4, 5, 6]) == n.a.pages([1, 2, 3])
    finally:
        proxy.close()


def test_a_peer_that_never_accepts_fails_the_transfer_unavailable(nodes: Nodes) -> None:
    n = nodes
    proxy = DroppingProxy(n.peer, drop=-1)
    try:
        kv = n.a.kv
        kv.send_delta("t-gone", n.a.bs, src_page_indices=[1], peer_address=proxy.address, deadline_ms=5000)
        (s,) = n.a.kv.wait("t-gone", timeout=20)
        assert s.state == "FAILED" and "UNAVAILABLE" in s.error and proxy.address in s.error, s
        assert proxy.dropped >= 4  # every attempt of the retry policy
    finally:
        proxy.close()
