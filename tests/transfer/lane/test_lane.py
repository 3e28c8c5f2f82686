"""The native lane end to end on CPU (shm pools, memcpy in the native thread): one service, two
engines; what the lane takes, what it hands back to gRPC, and that it never writes a page the
receiver did not name or after an Abort returned."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import Client, Layout, lane_wire
from kvservice_client._errors import InvalidArgument

from tests.support.lane import LAYOUT, Engines
from tests.support.poll import eventually


@pytest.fixture
def eng(make_server: Any) -> Iterator[Engines]:
    e = Engines(make_server(transport="loopback"))
    yield e
    e.close()


def test_same_node_transfer_goes_over_the_lane_byte_exact(eng: Engines) -> None:
    book = eng.lane.book
    src, dst = [3, 9, 14, 20, 27], [30, 1, 7]
    before = eng.snapshot()
    eng.kb.expect_delta("t-lane", eng.b, prefix_pages=2, dst_page_indices=dst)
    st = eng.ka.send_delta("t-lane", eng.a, src_page_indices=src, peer_address=eng.peer)
    assert st.route_note == "" and st.path == "FUSED"
    (r,) = eng.kb.wait("t-lane", timeout=10)
    (s,) = eng.ka.wait("t-lane", timeout=10)
    assert (r.state, s.state) == ("DONE", "DONE")
    assert (r.pages_sent, r.pages_skipped, r.bytes_sent) == (3, 2, 3 * LAYOUT.page_bytes_all_layers)
    assert r.route_note == "lane" and s.route_note == "lane", "the END came over the lane"
    assert eng.pages(eng.pb, dst) == eng.pages(eng.pa, src[2:])
    assert eng.changed_pages(before) <= set(dst)
    assert eng.ka.lane_sent == 1
    # Python's bookkeeping follows: both records DONE, the lane entry gone, nothing live
    eventually(lambda: book.sent == 1, 10, "finalized")
    polled = {x.role: x for x in eng.kb.poll(["t-lane"]) + eng.ka.poll(["t-lane"])}
    assert polled["RECEIVER"].state == polled["SENDER"].state == "DONE"
    assert polled["RECEIVER"].pages_sent == 3 and polled["SENDER"].path == "FUSED"
    assert book.n.armed_count() == 0
    assert eng.server.node.transfers.table.live() == []


@pytest.mark.parametrize(
    "layout",
    [  # 20 MiB: on the bulk thread (>= 16 MiB), over threads (>= 4 MiB), 16-byte runs streamed
        Layout.mha(num_layers=8, page_size=16, num_pages=400, total_kv_heads=2, head_dim=64, dtype="float16"),
        # 42-byte page runs: no 16-byte alignment, memcpy; 1.3 MiB on one thread
        Layout.mha(num_layers=4, page_size=3, num_pages=4096, total_kv_heads=1, head_dim=7, dtype="float16"),
    ],
    ids=["20MiB-bulk-threads", "unaligned"],
)
def test_large_host_copy_on_the_lane_is_byte_exact(make_server: Any, layout: Layout) -> None:
    """The lane's host copy (region-major jobs, streamed stores, threads for large ones, the bulk
    thread for larger ones) writes exactly the named pages, each from its source page."""
    eng = Engines(make_server(transport="loopback"), layout)
    try:
        rng = np.random.default_rng(5)
        n = layout.num_pages * 4 // 5
        src = rng.choice(layout.num_pages, n, replace=False).tolist()
        dst = rng.choice(layout.num_pages, n, replace=False).tolist()
        before = eng.snapshot()
        eng.kb.expect_delta("big", eng.b, prefix_pages=0, dst_page_indices=dst)
        eng.ka.send_delta("big", eng.a, src_page_indices=src, peer_address=eng.peer)
        (r,) = eng.kb.wait("big", timeout=30)
        assert r.state == "DONE" and r.route_note == "lane", r
        assert r.bytes_sent == n * layout.page_bytes_all_layers
        assert eng.pages(eng.pb, dst) == eng.pages(eng.pa, src)
        assert eng.changed_pages(before) <= set(dst)
    finally:
        eng.close()


def test_many_transfers_each_once_and_nothing_left(eng: Engines) -> None:
    book = eng.lane.book
    for i in range(60):
        tid = f"m-{i}"
        eng.kb.expect_delta(tid, eng.b, prefix_pages=0, dst_page_indices=[i % 32])
        eng.ka.send_delta(tid, eng.a, src_page_indices=[(i * 7) % 32], peer_address=eng.peer)
        (r,) = eng.kb.wait(tid, timeout=10)
        assert r.state == "DONE", r
        eng.ka.wait(tid, timeout=10)
    assert eng.ka.lane_sent == 60
    eventually(lambda: book.sent == 60, 10, "all finalized")
    eventually(lambda: not eng.server.node.transfers.table.live(), 5, "no live record")
    assert book.n.armed_count() == 0


def test_send_before_expect_falls_back_to_grpc(eng: Engines) -> None:
    """Not armed yet: the lane answers fallback and the gRPC SendDelta waits for the declaration."""
    eng.ka.send_delta("early", eng.a, src_page_indices=[5], peer_address=eng.peer)
    eng.kb.expect_delta("early", eng.b, prefix_pages=0, dst_page_indices=[6])
    (r,) = eng.kb.wait("early", timeout=10)
    assert r.state == "DONE" and r.route_note != "lane"
    assert eng.ka.lane_sent == 0
    assert eng.pages(eng.pb, [6]) == eng.pages(eng.pa, [5])


def test_bad_source_page_gets_the_grpc_error_and_changes_nothing(eng: Engines) -> None:
    before = eng.snapshot()
    eng.kb.expect_delta("bad", eng.b, prefix_pages=0, dst_page_indices=[4])
    with pytest.raises(InvalidArgument, match="src_page_indices"):
        eng.ka.send_delta("bad", eng.a, src_page_indices=[99], peer_address=eng.peer)
    assert eng.changed_pages(before) == set()
    eng.ka.send_delta("bad", eng.a, src_page_indices=[8], peer_address=eng.peer)  # armed still
    (r,) = eng.kb.wait("bad", timeout=10)
    assert r.state == "DONE" and eng.pages(eng.pb, [4]) == eng.pages(eng.pa, [8])


def test_a_page_beyond_i32_is_not_wrapped_onto_a_real_page(eng: Engines) -> None:
    """The SDK sends i64 pages unchecked (FLAG_SRC_I64): 2**32 + 8 must not land as page 8."""
    before = eng.snapshot()
    eng.kb.expect_delta("wide", eng.b, prefix_pages=0, dst_page_indices=[4])
    with pytest.raises(InvalidArgument, match="src_page_indices"):
        eng.ka.send_delta("wide", eng.a, src_page_indices=np.array([2**32 + 8]), peer_address=eng.peer)
    assert eng.changed_pages(before) == set()
    assert eng.ka.lane_sent == 0


def test_a_raw_i64_send_is_checked_and_its_end_carries_the_timeline(eng: Engines) -> None:
    s = _raw_lane(eng.server)
    try:
        s.send(lane_wire.hello(eng.ka.session_id))
        assert lane_wire.parse_welcome(s.recv(4096))["src_i64"] is True
        eng.kb.expect_delta("raw64", eng.b, prefix_pages=0, dst_page_indices=[12])
        flags = lane_wire.FLAG_SRC_I64
        s.send(lane_wire.encode_send(1, "raw64", eng.a, np.array([-(2**40)]), flags))
        msg = lane_wire.decode(s.recv(4096))
        assert isinstance(msg, lane_wire.Reply) and msg[1] == lane_wire.FALLBACK
        assert msg[2] == "source page out of range"
        s.send(lane_wire.encode_send(2, "raw64", eng.a, np.array([6]), flags))
        got = [s.recv(4096) for _ in range(2)]  # its REPLY and the sender's END (any order)
        kinds = {type(lane_wire.decode(m)).__name__: m for m in got}
        assert lane_wire.decode(kinds["Reply"])[1] == lane_wire.ACCEPTED
        end = lane_wire.decode(kinds["End"])
        assert end[1] is True and end[2] == "raw64"
        at = lane_wire.end_times(kinds["End"])
        assert at is not None and len(at) == 5  # read, checked, launched, done, sent: in order
        assert list(at) == sorted(at)
    finally:
        s.close()
    (r,) = eng.kb.wait("raw64", timeout=10)
    assert r.state == "DONE" and eng.pages(eng.pb, [12]) == eng.pages(eng.pa, [6])


def test_page_count_mismatch_is_not_taken(eng: Engines) -> None:
    """More pages than prefix + delta: the lane does not take it; gRPC fails it with its reason."""
    before = eng.snapshot()
    eng.kb.expect_delta("over", eng.b, prefix_pages=0, dst_page_indices=[4])
    eng.ka.send_delta("over", eng.a, src_page_indices=[8, 9], peer_address=eng.peer)
    (r,) = eng.kb.wait("over", timeout=10)
    assert r.state == "FAILED"
    assert eng.ka.lane_sent == 0
    assert eng.changed_pages(before) == set()


def test_abort_disarms_no_byte_after(eng: Engines) -> None:
    before = eng.snapshot()
    eng.kb.expect_delta("ab", eng.b, prefix_pages=0, dst_page_indices=[10, 11])
    eng.kb.abort("ab")
    assert eng.lane.book.n.armed_count() == 0
    st = eng.ka.send_delta("ab", eng.a, src_page_indices=[1, 2], peer_address=eng.peer)
    assert st.route_note != "lane"
    (s,) = eng.ka.wait("ab", timeout=10)
    assert s.state in ("FAILED", "ABORTED")
    assert eng.changed_pages(before) == set()


def test_deadline_disarms(eng: Engines) -> None:
    eng.kb.expect_delta("late", eng.b, prefix_pages=0, dst_page_indices=[12], deadline_ms=50)
    (r,) = eng.kb.wait("late", timeout=10)
    assert r.state == "FAILED" and r.error_code == "DEADLINE_EXCEEDED"
    assert eng.lane.book.n.armed_count() == 0


def test_a_grpc_sender_takes_an_armed_transfer_from_the_lane(eng: Engines, make_server: Any) -> None:
    """Another engine sends it over gRPC first: the gate disarms it; a later lane SEND falls back
    and the lane never writes it."""
    plain = Client(eng.server.address, client_name="plain", lane=False)
    try:
        pc = plain.register_buffers(LAYOUT, eng.pa.k_regions, eng.pa.v_regions).buffer_set_id
        eng.kb.expect_delta("g", eng.b, prefix_pages=0, dst_page_indices=[13])
        plain.send_delta("g", pc, src_page_indices=[2], peer_address=eng.peer)
        (r,) = eng.kb.wait("g", timeout=10)
        assert r.state == "DONE" and r.route_note != "lane"
        assert eng.lane.book.n.armed_count() == 0
        assert eng.pages(eng.pb, [13]) == eng.pages(eng.pa, [2])
    finally:
        plain.close()


def test_unregistered_receiver_pool_is_never_written(eng: Engines) -> None:
    before = eng.snapshot()
    eng.kb.expect_delta("u", eng.b, prefix_pages=0, dst_page_indices=[14])
    eng.kb.unregister_buffers(eng.b)
    st = eng.ka.send_delta("u", eng.a, src_page_indices=[3], peer_address=eng.peer)
    assert st.route_note != "lane"
    assert eng.changed_pages(before) == set()


def _raw_lane(server: Any) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(lane_wire.lane_path(server.app.uds_path))
    return s


def test_lane_refuses_an_unknown_session(eng: Engines) -> None:
    s = _raw_lane(eng.server)
    try:
        s.send(lane_wire.hello("not-a-session"))
        w = lane_wire.parse_welcome(s.recv(4096))
        assert w["ok"] is False and "no such session" in w["error"]
        assert s.recv(4096) == b""  # closed
    finally:
        s.close()


OTHER_UID = 65534


# The other uid's process: a fresh interpreter (started as root, no threads) that drops to ``uid``
# and says hello. Not a fork of this process: a fork of a process with gRPC's threads running
# crashed once in the child (SIGSEGV), and /root's interpreter is not readable by ``uid``.
_HELLO_AS = """
import os, socket, sys
uid, path, hello = int(sys.argv[1]), sys.argv[2], bytes.fromhex(sys.argv[3])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(5)
s.connect(path)
s.send(hello)
sys.stdout.buffer.write(s.recv(4096))
"""


def _hello_as(uid: int, path: str, session_id: str) -> dict[str, Any]:
    """A real process of ``uid`` says hello on the lane naming ``session_id``."""
    import json
    import subprocess
    import sys

    hello = lane_wire.hello(session_id).hex()
    p = subprocess.run(
        [sys.executable, "-c", _HELLO_AS, str(uid), path, hello], capture_output=True, timeout=30, check=False
    )
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return json.loads(p.stdout)


@pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED") or __import__("os").getuid() != 0, reason="needs root")
@pytest.mark.parametrize("allowed", ["", "12345"])
def test_another_uid_cannot_take_a_session_onto_the_lane(make_server: Any, allowed: str) -> None:
    """Knowing a victim engine's session id is not enough: the kernel's uid decides (and
    allowed_uids, when set, refuses before the session is even looked at)."""
    import os

    server = make_server(transport="loopback", allowed_uids=allowed, uds_mode="0666")
    os.chmod(os.path.dirname(server.app.uds_path), 0o755)
    e = Engines(server)
    try:
        w = _hello_as(OTHER_UID, lane_wire.lane_path(server.app.uds_path), e.kb.session_id)
        assert w["ok"] is False
        assert ("allowed_uids" if allowed else "another uid") in w["error"], w
    finally:
        e.close()


def test_garbage_on_an_admitted_lane_drops_only_that_connection(eng: Engines) -> None:
    s = _raw_lane(eng.server)
    try:
        s.send(lane_wire.hello(eng.ka.session_id))
        assert lane_wire.parse_welcome(s.recv(4096))["ok"] is True
        s.send(b"\x01\x00")  # too short for a SEND
        assert s.recv(4096) == b""
    finally:
        s.close()
    eng.kb.expect_delta("after", eng.b, prefix_pages=0, dst_page_indices=[15])
    eng.ka.send_delta("after", eng.a, src_page_indices=[4], peer_address=eng.peer)
    (r,) = eng.kb.wait("after", timeout=10)
    assert r.state == "DONE" and r.route_note == "lane"


def test_another_sessions_buffer_set_is_not_sent_over_the_lane(eng: Engines) -> None:
    """The lane checks the SEND's buffer set belongs to the connection's session."""
    s = _raw_lane(eng.server)
    try:
        s.send(lane_wire.hello(eng.kb.session_id))  # the receiver's session...
        assert lane_wire.parse_welcome(s.recv(4096))["ok"] is True
        eng.kb.expect_delta("own", eng.b, prefix_pages=0, dst_page_indices=[16])
        s.send(lane_wire.encode_send(7, "own", eng.a, np.array([5])))  # ...naming the sender's pool
        msg = lane_wire.decode(s.recv(4096))
        assert isinstance(msg, lane_wire.Reply) and msg[1] == lane_wire.FALLBACK
    finally:
        s.close()
    assert eng.lane.book.n.armed_count() == 1


def test_service_stops_with_a_lane_open_and_a_transfer_armed() -> None:
    from tests.support.services import ServerThread, make_config

    server = ServerThread(make_config(transport="loopback"))
    e = Engines(server)
    native = e.lane.native
    e.kb.expect_delta("x", e.b, prefix_pages=0, dst_page_indices=[1])
    assert native.armed_count() == 1 and native.conns() == 1  # the receiver opened its lane
    server.stop()
    assert native.armed_count() == 0, "the stop aborted it, which disarmed it"
    assert not os.path.exists(lane_wire.lane_path(server.app.uds_path))
    e.close()


def test_callers_read_the_lane_with_many_fds_open_and_many_threads(make_server: Any) -> None:
    """The caller that finds nobody reading takes its REPLY / END on its own thread (poll, not
    select: an engine holds more than 1,024 fds); concurrent senders and waiters all finish,
    every transfer over the lane, none falling back to gRPC."""
    import threading

    held = [os.pipe() for _ in range(600)]  # 1,200 fds: the lane's own fds land above 1,024
    try:
        eng = Engines(make_server(transport="loopback"))
        try:
            errors: list[BaseException] = []

            def worker(w: int) -> None:
                try:
                    for i in range(15):
                        tid = f"fd-{w}-{i}"
                        eng.kb.expect_delta(tid, eng.b, prefix_pages=0, dst_page_indices=[w])
                        eng.ka.send_delta(tid, eng.a, src_page_indices=[w + 8], peer_address=eng.peer)
                        (r,) = eng.kb.wait(tid, timeout=10)
                        assert r.state == "DONE" and r.route_note == "lane", r
                        eng.ka.wait(tid, timeout=10)
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

            threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors[0]
            assert eng.ka.lane_sent == 90
            assert eng.pages(eng.pb, list(range(6))) == eng.pages(eng.pa, list(range(8, 14)))
        finally:
            eng.close()
    finally:
        for r, w in held:
            os.close(r)
            os.close(w)


def _waiter_spin(k: Client, eng: Engines, tid: str) -> int:
    """Open ``k``'s lane with one transfer, then what its waiters spin (µs)."""
    eng.kb.expect_delta(tid, eng.b, prefix_pages=0, dst_page_indices=[3])
    eng.ka.send_delta(tid, eng.a, src_page_indices=[5], peer_address=eng.peer)
    (r,) = eng.kb.wait(tid, timeout=10)
    assert r.state == "DONE" and r.route_note == "lane", r
    lane = k._lane.lane
    assert lane is not None
    return int(lane.spin_us)


def test_waiters_spin_as_the_service_advises_unless_the_engine_says(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lane_wait_spin_us travels in the welcome (auto: 0 on a lane without a GPU); an engine's
    own setting (Client(lane_spin_us=), KVSERVICE_LANE_SPIN_US) wins over it."""
    monkeypatch.delenv("KVSERVICE_LANE_SPIN_US", raising=False)
    eng = Engines(make_server(transport="loopback"))
    try:
        assert _waiter_spin(eng.ka, eng, "auto") == 0 and eng.kb._lane.lane.spin_us == 0
    finally:
        eng.close()
    eng = Engines(make_server(transport="loopback", lane_wait_spin_us=300))
    try:
        assert _waiter_spin(eng.ka, eng, "told") == 300 and eng.kb._lane.lane.spin_us == 300
        with Client(eng.server.address, client_name="own", lane_spin_us=0) as own:
            own.register_buffers(eng.layout, eng.pa.k_regions, eng.pa.v_regions)
            lane = own._lane.get(own.session_id)
            assert lane is not None and lane.spin_us == 0
        monkeypatch.setenv("KVSERVICE_LANE_SPIN_US", "40")
        with Client(eng.server.address, client_name="env") as env:
            lane = env._lane.get(env.session_id)
            assert lane is not None and lane.spin_us == 40
    finally:
        eng.close()


def test_a_bad_wait_spin_is_refused_at_start() -> None:
    from kvservice.config import ConfigError
    from tests.support.services import make_config

    with pytest.raises(ConfigError, match="lane_wait_spin_us"):
        make_config(lane_wait_spin_us=-2)
