"""A time-bounded fuzz of the lane socket: seeded random and mutated frames (SEND, SEND_TO,
hellos), over many connections, admitted and not, truncated and oversized. After each round the
service answers, a legitimate transfer completes byte exact, and no byte outside the pages that
transfer named changed in any engine's pool."""

from __future__ import annotations

import random
import socket
import time
from typing import Any

import numpy as np
import pytest
from kvservice_client import lane_wire

from tests.support.nodes import Node, eventually

ROUNDS_S = 20.0  # wall time of the whole fuzz (CI-bounded)
SEED = 20261202


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(0.5)
    s.connect(path)
    return s


def _frames(rng: random.Random, n: Node) -> list[bytes]:
    """One round's frames: valid ones naming real and unknown ids, then mutated and random."""
    src = np.array([rng.randrange(-5, 40) for _ in range(rng.randrange(0, 6))], dtype=np.int64)
    valid = [
        lane_wire.encode_send(rng.randrange(1 << 32), "fz", n.a.bs, src),
        lane_wire.encode_send(rng.randrange(1 << 32), "fz", n.b.bs, src, flags=rng.randrange(4)),
        lane_wire.encode_send_to(rng.randrange(1 << 32), "fz", n.a.bs, src, rng.randrange(4), n.peer),
        lane_wire.hello("x" * rng.randrange(0, 64)),
    ]
    out = []
    for f in valid:
        b = bytearray(f)
        for _ in range(rng.randrange(0, 8)):  # flip bytes (headers: lengths, counts, flags)
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        cut = rng.choice([len(b), rng.randrange(len(b) + 1), len(b) + rng.randrange(64)])
        out.append(bytes(b[:cut]) + bytes(rng.randrange(256) for _ in range(max(0, cut - len(b)))))
    out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))))
    out.append(b"[" * rng.randrange(1, 5000))  # nested past any parser's depth
    return out


def test_lane_socket_fuzz_leaves_the_service_serving_and_pages_untouched(make_server: Any) -> None:
    """Random and mutated frames on admitted and unadmitted lane connections change nothing."""
    n = Node(make_server(transport="loopback", lane=True), True)
    rng = random.Random(SEED)
    path = lane_wire.lane_path(n.server.app.uds_path)
    sessions = [n.a.kv.session_id, n.b.kv.session_id, "no-such-session"]
    rounds = 0
    try:
        end = time.monotonic() + ROUNDS_S
        while time.monotonic() < end:
            rounds += 1
            before = {e: e.snapshot() for e in (n.a, n.b, n.c)}
            conns = []
            for _ in range(rng.randrange(1, 12)):
                try:
                    s = _connect(path)
                except OSError:
                    continue
                conns.append(s)
                if rng.random() < 0.7:  # admitted (a real session of this uid) or refused
                    s.send(lane_wire.hello(rng.choice(sessions)))
                    try:
                        s.recv(4096)
                    except OSError:
                        pass
                for f in _frames(rng, n):
                    if f:
                        try:
                            s.send(f)
                        except OSError:
                            break
            for s in conns:
                if rng.random() < 0.5:
                    s.close()
            # the service answers, moves a legitimate transfer byte exact, and nothing else changed
            tid = f"legit{rounds}"
            src, dst = sorted(rng.sample(range(32), 2)), sorted(rng.sample(range(32), 2))
            r, s_ = n.move(tid, src, dst, into=n.c)
            assert (r.state, s_.state) == ("DONE", "DONE"), (rounds, r, s_)
            assert n.c.pages(dst) == n.a.pages(src)
            assert n.c.changed(before[n.c]) <= set(dst), f"round {rounds}: a page outside {dst} changed"
            assert n.a.changed(before[n.a]) == set() and n.b.changed(before[n.b]) == set(), rounds
            for s in conns:
                s.close()
        table = n.server.node.transfers.table  # the lane books its ENDs after the engines have them
        eventually(lambda: table.live() == [], 10, "every transfer booked, none left unfinished")
        assert rounds >= 5, f"only {rounds} rounds in {ROUNDS_S}s"
    finally:
        n.close()


@pytest.mark.parametrize("hello", [b"[" * 5000, b"{" * 3000, b"\xff" * 2000, b'{"v": 1, "session_id": 5}'])
def test_a_malformed_hello_is_refused_with_a_reason(make_server: Any, hello: bytes, caplog: Any) -> None:
    """A hello the parser cannot read is answered with a refusal, never an unhandled exception."""
    n = Node(make_server(transport="loopback", lane=True), True)
    try:
        s = _connect(lane_wire.lane_path(n.server.app.uds_path))
        s.settimeout(5)
        s.send(hello)
        w = lane_wire.parse_welcome(s.recv(4096))
        assert w["ok"] is False and "not a lane hello" in w["error"], w
        assert s.recv(4096) == b""
        s.close()
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        assert "never retrieved" not in caplog.text
    finally:
        n.close()
