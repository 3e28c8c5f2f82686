"""The lane listener's limits hold under abuse: connections waiting for a hello are capped,
admitted connections are capped per session, and running out of fds backs off with one log
line instead of spinning on a readable socket; the lane serves again once fds are back."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import time
from typing import Any

from kvservice_client import lane_wire

from kvservice.transfer.lane.listener import MAX_CONNS_PER_SESSION, MAX_PENDING
from tests.support.nodes import Node, eventually


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(path)
    return s


def test_connections_per_session_are_capped(make_server: Any) -> None:
    """Past MAX_CONNS_PER_SESSION admitted connections a session's next hello is refused."""
    n = Node(make_server(transport="loopback", lane=True), True)
    path = lane_wire.lane_path(n.server.app.uds_path)
    conns = []
    try:
        native = n.server.app.lane.result().native
        while native.conns_of(n.a.kv.session_id) < MAX_CONNS_PER_SESSION:
            s = _connect(path)
            conns.append(s)
            s.send(lane_wire.hello(n.a.kv.session_id))
            assert lane_wire.parse_welcome(s.recv(4096))["ok"] is True
            want = min(len(conns), MAX_CONNS_PER_SESSION)
            eventually(lambda w=want: native.conns_of(n.a.kv.session_id) >= w, 5, "admitted")
        s = _connect(path)
        conns.append(s)
        s.send(lane_wire.hello(n.a.kv.session_id))
        w = lane_wire.parse_welcome(s.recv(4096))
        assert w["ok"] is False and "lane connections already" in w["error"], w
        # another session is not affected
        r, s_ = n.move("other", [1], [2], into=n.c)
        assert (r.state, s_.state) == ("DONE", "DONE")
    finally:
        for c in conns:
            c.close()
        n.close()


def test_connections_without_a_hello_are_capped(make_server: Any) -> None:
    """Past MAX_PENDING silent connections, a new one is closed at once, unread."""
    n = Node(make_server(transport="loopback", lane=True), True)
    path = lane_wire.lane_path(n.server.app.uds_path)
    listener = n.server.app.lane.result().listener
    silent = []
    try:
        for _ in range(MAX_PENDING):
            silent.append(_connect(path))
        eventually(lambda: len(listener._tasks) >= MAX_PENDING, 5, "pending hellos")
        late = _connect(path)
        silent.append(late)
        assert late.recv(4096) == b"", "a connection past the cap was not closed"
        assert listener.shed >= 1
    finally:
        for c in silent:
            c.close()
        n.close()


def test_out_of_fds_backs_off_logs_once_and_recovers(make_server: Any, caplog: Any) -> None:
    """EMFILE at accept: no traceback, one rate-limited line, then lanes open again."""
    n = Node(make_server(transport="loopback", lane=True), True)
    path = lane_wire.lane_path(n.server.app.uds_path)
    listener = n.server.app.lane.result().listener
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[socket.socket] = []
    caplog.set_level(logging.INFO, logger="kvservice.transfer.lane.listener")
    try:
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + 40, hard))
        with contextlib.suppress(OSError):
            while True:  # both ends live in this process: fds run out on the service's accept
                held.append(_connect(path))
        time.sleep(1.0)
        assert listener.backoffs >= 1, "accept never ran out of fds"
        lines = [r for r in caplog.records if r.name == "kvservice.transfer.lane.listener"]
        assert not [r for r in lines if r.exc_info], "a traceback was logged"
        said = [r.getMessage() for r in lines]
        assert len([m for m in said if "lane accept" in m]) == 1, said
    finally:
        for c in held:
            c.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        r, s = n.move("after", [3], [4], into=n.c)  # the engines' lanes open again
        assert (r.state, s.state) == ("DONE", "DONE")
        s2 = _connect(path)
        s2.send(lane_wire.hello(n.c.kv.session_id))
        assert eventually(lambda: lane_wire.parse_welcome(s2.recv(4096)), 5)["ok"] is True
        s2.close()
    finally:
        n.close()


def test_a_closed_sessions_lane_is_shut_down_and_closed_by_the_lane_thread(make_server: Any) -> None:
    """Closing a session ends its lane connections (the engine reads EOF) and frees their fds:
    the lane thread closes them, and new connections (reusing the numbers) carry only their own."""
    n = Node(make_server(transport="loopback", lane=True), True)
    path = lane_wire.lane_path(n.server.app.uds_path)
    native = n.server.app.lane.result().native
    try:
        mine = []
        for _ in range(3):
            s = _connect(path)
            s.send(lane_wire.hello(n.b.kv.session_id))
            assert lane_wire.parse_welcome(s.recv(4096))["ok"] is True
            mine.append(s)
        sid = n.b.kv.session_id
        eventually(lambda: native.conns_of(sid) >= 3, 5, "admitted")
        n.b.kv.close()  # the session ends: the service drops its lane connections
        for s in mine:
            assert s.recv(4096) == b"", "a dropped session's connection was not shut down"
            s.close()
        eventually(lambda: native.conns_of(sid) == 0, 5, "the lane thread closed them")
        for _ in range(20):  # fd numbers are reused: each new connection gets only its own answers
            r, s_ = n.move(f"after{_}", [1], [2], into=n.c)
            assert (r.state, s_.state) == ("DONE", "DONE")
    finally:
        n.close()
