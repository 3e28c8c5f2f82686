"""The cross-node lane between service processes (NIXL over UCX, shm pools): a receiving service
SIGKILLed while its lane holds a transfer the sender wrote. The sender's lane gets no ack and
ends the transfer FAILED (a second past its deadline at most), frees it, and keeps serving."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvservice_client import Layout

from tests.support.engines import EngineProc
from tests.support.poll import eventually
from tests.support.services import FAULTY_LAUNCHER as FAULTY
from tests.support.services import ServiceProc, admin_stats

pytest.importorskip("nixl")
LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=64, total_kv_heads=2, head_dim=16, dtype="bfloat16")


def _poll(eng: EngineProc, tid: str) -> Any:
    sts = eng.call("poll", [tid])
    return sts[0] if sts and all(s.terminal for s in sts) else None


@contextlib.contextmanager
def _pair(tx_env: dict[str, str], rx_env: dict[str, str]) -> Iterator[tuple[Any, ...]]:
    a = ServiceProc("lane-tx", "--same-host-route", "off", integrity=False, launcher=FAULTY, env=tx_env)
    c = ServiceProc("lane-rx", "--same-host-route", "off", integrity=False, launcher=FAULTY, env=rx_env)
    engines: list[EngineProc] = []
    try:
        a.wait_ready()
        c.wait_ready()
        ea, ec = EngineProc(a.address, LAYOUT, seed=1), EngineProc(c.address, LAYOUT, seed=2)
        engines += [ea, ec]
        ea.ready()
        ec.ready()
        yield a, c, ea, ec
    finally:
        for e in engines:
            e.stop()
        a.stop()
        c.stop()


@pytest.fixture
def pair() -> Iterator[tuple[Any, ...]]:
    with _pair({}, {"KVS_TEST_SLOW_LANE_UNPACK_US": "3000000"}) as p:  # each unpack waits 3 s: kill it then
        yield p


def _onto_the_lane(a: ServiceProc, c: ServiceProc, ea: EngineProc, ec: EngineProc, tries: int = 5) -> Any:
    """A first transfer opens A's channel to C (gRPC): offers travel on it afterwards; then one
    over the lane: from now on A's lane waits for C's offers (20 ms) instead of falling back."""
    ec.call("expect_delta", "warm", ec.bs, prefix_pages=0, dst_page_indices=[0], sender_address=a.address)
    ea.call("send_delta", "warm", ea.bs, src_page_indices=[0], peer_address=c.address)
    eventually(lambda: _poll(ec, "warm") is not None, 30, "warm transfer")
    assert _poll(ec, "warm").state == "DONE"
    for i in range(tries):
        ec.call(
            "expect_delta", f"lw{i}", ec.bs, prefix_pages=0, dst_page_indices=[1], sender_address=a.address
        )
        time.sleep(1.0)  # the offer reaches A's lane
        ea.call("send_delta", f"lw{i}", ea.bs, src_page_indices=[1], peer_address=c.address)
        sent = eventually(lambda i=i: _poll(ea, f"lw{i}"), 30, "lane warm-up")
        if sent.route_note == "cross-node lane":
            break
    return sent


def test_receiver_killed_while_its_lane_holds_the_write(pair: Any) -> None:
    a, c, ea, ec = pair
    sent = _onto_the_lane(a, c, ea, ec)
    assert sent.state == "DONE" and sent.route_note == "cross-node lane", sent

    ec.call(
        "expect_delta",
        "killed",
        ec.bs,
        prefix_pages=0,
        dst_page_indices=[5, 6, 7],
        sender_address=a.address,
        deadline_ms=2000,
    )
    time.sleep(1.0)  # the offer reaches A's lane
    t0 = time.monotonic()
    ea.call("send_delta", "killed", ea.bs, src_page_indices=[1, 2, 3], peer_address=c.address)
    time.sleep(0.5)  # written and noted; C's lane sits in the 3 s before its unpack
    c.kill()
    s = eventually(lambda: _poll(ea, "killed"), 10, "the sender's end")
    took = time.monotonic() - t0
    assert s.state == "FAILED" and "acknowledge" in s.error, s
    assert s.route_note == "cross-node lane", s
    assert took < 2.0 + 1.0 + 1.0, took  # deadline + the lane's second + polling
    st = admin_stats(a.address)
    assert all(p.slots_in_use == 0 for p in st.staging), st.staging
    # A's lane is not wedged: its engine's next transfer (to a fresh C) completes
    c.restart()
    ec2 = EngineProc(c.address, LAYOUT, seed=3).ready()
    try:
        ec2.call(
            "expect_delta", "after", ec2.bs, prefix_pages=0, dst_page_indices=[9], sender_address=a.address
        )
        ea.call("send_delta", "after", ea.bs, src_page_indices=[4], peer_address=c.address)
        eventually(lambda: _poll(ec2, "after") is not None, 30, "a transfer after the kill")
        got = _poll(ec2, "after")
        sa = _poll(ea, "after")
        assert got.state == "DONE", (got.error, got.route_note, sa and (sa.state, sa.error, sa.route_note))
    finally:
        ec2.stop()


def test_handshakes_wait_for_a_lane_that_is_still_starting() -> None:
    """Both services' lanes come up 1 s late: the engines register and the first transfer starts
    before; its handshakes wait for the lanes (up to LANE_SETTLE_S), so the next transfer takes
    the lane (the CI failure of 2026-11-28: TRITON_INTERPRET=1 slowed the lanes' start, and a
    handshake made before left the peer off the lane for good)."""
    late = {"KVS_TEST_SLOW_LANE_START_S": "1"}
    with _pair(late, late) as (a, c, ea, ec):
        sent = _onto_the_lane(a, c, ea, ec, tries=1)
        assert sent.state == "DONE" and sent.route_note == "cross-node lane", sent


def test_a_lane_that_comes_up_after_the_handshakes_is_used_after_all() -> None:
    """Lanes 4 s late (a first build), past what a handshake waits: the first transfers go over
    gRPC without them; when each lane comes up its service moves its epoch and makes its own
    handshakes stale, so both sides handshake again and a later transfer takes the lane."""
    late = {"KVS_TEST_SLOW_LANE_START_S": "4"}
    with _pair(late, late) as (a, c, ea, ec):
        sent = _onto_the_lane(a, c, ea, ec, tries=4)
        assert sent.state == "DONE" and sent.route_note == "cross-node lane", sent
