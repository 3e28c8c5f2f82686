"""The fault matrix, with real processes: ``python -m kvservice`` services (NIXL over UCX on
DRAM) and engine processes owning their shm pools.

    SIGSTOP / SIGKILL of the sending service, the receiving service, the sending engine and the
    receiving engine mid-transfer; a service restarted under connected engines; the link between
    two services (veth between network namespaces) going down and coming back.

Each test asserts: every transfer ends DONE, FAILED or ABORTED with a reason within its
deadline; no byte lands in the receiver's pool once its transfer ended; staging slots, buffer
sets and sessions all come back (read from GetStats).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvservice_client import Client, Layout, SessionLost, ShmKVPool

from kvservice.transfer.peer_channel import IDLE_RETURN_S
from tests.support.engines import EngineError, EngineProc
from tests.support.poll import eventually
from tests.support.pools import assert_unchanged, snapshot
from tests.support.services import ServiceProc, admin_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _netns import UCX_TCP_ENV, veth_pair  # noqa: E402

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=64, total_kv_heads=2, head_dim=16, dtype="bfloat16")
FAST = (
    "--same-host-route",
    "off",
    "--session-grace-s",
    "1",
    "--keepalive-time-ms",
    "1000",
    "--keepalive-timeout-ms",
    "1000",
    "--keepalive-min-ping-interval-ms",
    "500",
)
DEADLINE_MS = 4000
SLACK_S = 2.0  # reaper tick, process scheduling on a 2-core runner


def _stats(svc: ServiceProc) -> Any:
    return admin_stats(svc.address)


def _settled(svc: ServiceProc) -> bool:
    """No transfer in flight and every staging slot free."""
    st = _stats(svc)
    return st.transfers.in_flight == 0 and all(p.slots_in_use == 0 for p in st.staging)


def _terminal(eng: EngineProc, tid: str, timeout: float) -> Any:
    seen: list[Any] = [None]

    def terminal() -> Any:
        seen[0] = sts = eng.call("poll", [tid])
        return sts if sts and all(s.terminal for s in sts) else None

    return eventually(terminal, timeout, what=lambda: f"{tid} not terminal: {seen[0]}", interval=0.02)[0]


class Pair:
    """Sending and receiving service, one engine on each."""

    def __init__(self, *extra: str) -> None:
        self.stx, self.srx = ServiceProc("tx", *FAST, *extra), ServiceProc("rx", *FAST, *extra)
        self.engines: list[EngineProc] = []
        try:
            self.stx.wait_ready()
            self.srx.wait_ready()
            self.tx = EngineProc(self.stx.address, LAYOUT, seed=1)
            self.engines.append(self.tx)
            self.rx = EngineProc(self.srx.address, LAYOUT, seed=2)
            self.engines.append(self.rx)
            self.tx.ready()
            self.rx.ready()
        except BaseException:
            self.stop()
            raise

    def start(self, tid: str, first: int = 10, total: int = 30) -> None:
        """Declare ``total`` pages, send the first ``first`` and wait until they landed."""
        self.rx.call(
            "expect_delta",
            tid,
            self.rx.bs,
            prefix_pages=0,
            dst_page_indices=range(total),
            deadline_ms=DEADLINE_MS,
        )
        self.tx.call(
            "send_delta",
            tid,
            self.tx.bs,
            src_page_indices=range(first),
            peer_address=self.srx.address,
            last_chunk=False,
            path="packed",
            deadline_ms=DEADLINE_MS,
        )
        eventually(lambda: self.rx.call("poll", [tid])[0].pages_sent == first, 10, "first chunk landed")

    def stop(self) -> None:
        for p in (self.stx, self.srx):
            if p.proc.poll() is None:
                p.signal(signal.SIGCONT)
        for e in self.engines:
            if e.proc.is_alive():
                os.kill(e.proc.pid, signal.SIGCONT)
            e.stop()
        self.stx.stop()
        self.srx.stop()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.stop()


@pytest.mark.parametrize("side", ["sending", "receiving"])
def test_a_stopped_service_mid_transfer(pair: Pair, side: str) -> None:
    """SIGSTOP one service mid-transfer: the other side ends within its deadline; once the stopped
    one runs again it ends its side too (its engine, unanswered past the grace, may have been told
    SessionLost meanwhile); nothing lands after the receiver's end; every slot comes back."""
    tid = f"stop-{side}"
    pair.start(tid)
    t0 = time.monotonic()
    stopped, alive_eng = (pair.stx, pair.rx) if side == "sending" else (pair.srx, pair.tx)
    stopped.signal(signal.SIGSTOP)
    try:
        other = _terminal(alive_eng, tid, DEADLINE_MS / 1000 + SLACK_S)
        assert other.state == "FAILED" and other.error_code in ("DEADLINE_EXCEEDED", "UNAVAILABLE"), other
        assert other.error
        assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S
    finally:
        stopped.signal(signal.SIGCONT)
    eventually(lambda: _stats(stopped).transfers.in_flight == 0, SLACK_S + 3, "the resumed side ended")
    after = snapshot(pair.rx.pool)
    time.sleep(1.0)
    assert_unchanged(pair.rx.pool, after)
    for svc in (pair.stx, pair.srx):
        eventually(lambda svc=svc: _settled(svc), 3 * IDLE_RETURN_S + 3, f"{svc.dir}: settled")


@pytest.mark.parametrize("side", ["sending", "receiving"])
def test_a_killed_engine_mid_transfer(pair: Pair, side: str) -> None:
    """SIGKILL one engine mid-transfer: its service releases its session after the grace (1 s),
    aborting the transfer and telling the peer; both sides end with a reason long before the
    deadline; the dead engine's buffer set is gone and every slot is free."""
    tid = f"kill-eng-{side}"
    pair.start(tid)
    t0 = time.monotonic()
    victim, survivor, vsvc = (
        (pair.tx, pair.rx, pair.stx) if side == "sending" else (pair.rx, pair.tx, pair.srx)
    )
    victim.proc.kill()
    st = _terminal(survivor, tid, DEADLINE_MS / 1000 + SLACK_S)
    assert st.state in ("ABORTED", "FAILED") and st.error, st
    assert time.monotonic() - t0 < DEADLINE_MS / 1000  # the session's release, not the deadline
    eventually(lambda: not _stats(vsvc).buffer_sets, 5, "the dead engine's buffer set released")
    assert _stats(vsvc).sessions == 1  # the stats call's own
    for svc in (pair.stx, pair.srx):
        eventually(lambda svc=svc: _settled(svc), 3 * IDLE_RETURN_S + 3, "settled")


def test_a_stopped_engine_is_cut_released_and_told_what_it_lost(pair: Pair) -> None:
    """SIGSTOP both engines after the whole transfer was asked: the services finish it (DONE) on
    their own; the stopped engines stop answering keepalive pings, so past the grace their
    sessions are released; resumed, each engine's next call raises SessionLost naming its buffer
    set."""
    tid = "stop-engines"
    pair.rx.call(
        "expect_delta", tid, pair.rx.bs, prefix_pages=0, dst_page_indices=range(20), deadline_ms=DEADLINE_MS
    )
    pair.tx.call(
        "send_delta",
        tid,
        pair.tx.bs,
        src_page_indices=range(20),
        peer_address=pair.srx.address,
        deadline_ms=DEADLINE_MS,
    )
    for e in (pair.tx, pair.rx):
        os.kill(e.proc.pid, signal.SIGSTOP)
    try:
        for svc in (pair.stx, pair.srx):  # keepalive 1 s + 1 s, grace 1 s
            eventually(lambda svc=svc: not _stats(svc).buffer_sets, 15, "stopped engine's session released")
    finally:
        for e in (pair.tx, pair.rx):
            os.kill(e.proc.pid, signal.SIGCONT)
    for e in (pair.tx, pair.rx):
        with pytest.raises(EngineError) as info:
            e.call("poll", [tid])
        assert info.value.kind == "SessionLost" and e.bs in str(info.value), info.value
        assert not _stats(pair.stx).buffer_sets


def test_a_restarted_service_under_connected_engines(tmp_path: Any) -> None:
    """SIGKILL the receiving service and start it again on the same socket: the engine's SDK
    reconnects (with backoff), finds its session gone, says what it lost (SessionLost via the
    callback and on the next call), registers again and transfers as before."""
    stx, srx = ServiceProc("tx", *FAST), ServiceProc("rx", *FAST)
    tx = None
    pool = ShmKVPool.create(LAYOUT)
    lost: list[SessionLost] = []
    try:
        stx.wait_ready()
        srx.wait_ready()
        tx = EngineProc(stx.address, LAYOUT, seed=1).ready()
        kv = Client(srx.address, client_name="rx-engine", timeout=15, on_session_lost=lost.append)
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        srx.restart()
        eventually(lambda: bool(lost), 15, "the engine told its session is gone")
        with pytest.raises(SessionLost) as info:
            kv.expect_delta("after", bs, prefix_pages=0, dst_page_indices=[1])
        assert info.value.buffer_set_ids == (bs,)
        bs2 = kv.reopen_session(reregister=True)[bs].buffer_set_id
        tid = f"after-restart-{uuid.uuid4().hex[:6]}"
        kv.expect_delta(tid, bs2, prefix_pages=0, dst_page_indices=[5, 6], deadline_ms=DEADLINE_MS)
        tx.call("send_delta", tid, tx.bs, src_page_indices=[1, 2], peer_address=srx.address)
        (st,) = kv.wait(tid, timeout=10)
        assert st.state == "DONE", st
        assert np.array_equal(pool.k(0)[5], tx.pool.k(0)[1]) and np.array_equal(pool.v(1)[6], tx.pool.v(1)[2])
        kv.close()
        eventually(lambda: not _stats(srx).buffer_sets, 5, "released on close")
    finally:
        if tx is not None:
            tx.stop()
        pool.close()
        stx.stop()
        srx.stop()


def test_a_sender_that_talked_to_a_restarted_receiver_handshakes_again() -> None:
    """The receiving service restarts on the same address while the sender holds its handshake
    (agent, epoch) and an open channel: the new one's epochs start over, so its plans carry its
    service id and the sender handshakes again (before: every later transfer failed NOT_FOUND,
    written against the dead agent's memory). The cross-node lane is off: the gRPC route alone."""
    off = {"KVSERVICE_LANE_CROSS_MB": "0"}
    stx = ServiceProc("tx", *FAST, "--same-host-route", "off", env=off)
    srx = ServiceProc("rx", *FAST, "--same-host-route", "off", env=off)
    engines: list[EngineProc] = []
    try:
        stx.wait_ready()
        srx.wait_ready()
        tx = EngineProc(stx.address, LAYOUT, seed=1).ready()
        engines.append(tx)
        for turn in ("before", "after"):
            rx = EngineProc(srx.address, LAYOUT, seed=2).ready()
            engines.append(rx)
            for i in range(2):
                tid = f"{turn}-{i}"
                rx.call(
                    "expect_delta",
                    tid,
                    rx.bs,
                    prefix_pages=0,
                    dst_page_indices=[9 + i],
                    deadline_ms=DEADLINE_MS,
                )
                tx.call("send_delta", tid, tx.bs, src_page_indices=[4 + i], peer_address=srx.address)
                ended = lambda t=tid, e=rx: [s for s in e.call("poll", [t]) if s.terminal]  # noqa: E731
                (st,) = eventually(ended, 10, tid)
                assert st.state == "DONE", st
            if turn == "before":
                rx.stop()
                engines.remove(rx)
                srx.restart()
    finally:
        for e in engines:
            e.stop()
        stx.stop()
        srx.stop()


# -- the network between two services goes away ------------------------------------------------
def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def netns() -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair: 10.77.0.1 (ns-a) and 10.77.0.2 (ns-b)."""
    with contextlib.ExitStack() as stack:
        try:
            net = stack.enter_context(veth_pair())
        except (OSError, subprocess.CalledProcessError) as exc:
            if os.environ.get("CI") and os.geteuid() == 0:
                raise
            pytest.skip(f"network namespaces need root and iproute2 here: {exc}")
        yield net.names


def test_the_link_between_services_goes_down_and_comes_back(netns: tuple[str, str], tmp_path: Any) -> None:
    """Services in two network namespaces (engines reach them over their Unix sockets; peers
    over TCP on the veth, UCX on TCP only, a peer token between them). Link down mid-transfer:
    both sides end within the deadline, nothing lands after; link up: the next transfer works."""
    ns_a, ns_b = netns
    token = tmp_path / "peer-token"
    token.write_text(uuid.uuid4().hex + "\n")
    env = dict(UCX_TCP_ENV)
    common = (*FAST, "--peer-token-file", str(token))
    stx = ServiceProc("tx", *common, "--peer-tcp-address", "10.77.0.1:0", netns=ns_a, env=env)
    srx = ServiceProc("rx", *common, "--peer-tcp-address", "10.77.0.2:7777", netns=ns_b, env=env)
    engines: list[EngineProc] = []
    try:
        stx.wait_ready()
        srx.wait_ready()
        tx = EngineProc(stx.address, LAYOUT, seed=1).ready()
        rx = EngineProc(srx.address, LAYOUT, seed=2).ready()
        engines += [tx, rx]
        peer = "10.77.0.2:7777"

        def transfer(tid: str, n: int) -> tuple[Any, Any]:
            rx.call(
                "expect_delta", tid, rx.bs, prefix_pages=0, dst_page_indices=range(n), deadline_ms=DEADLINE_MS
            )
            tx.call(
                "send_delta",
                tid,
                tx.bs,
                src_page_indices=range(n),
                peer_address=peer,
                deadline_ms=DEADLINE_MS,
            )
            return _terminal(tx, tid, DEADLINE_MS / 1000 + SLACK_S), _terminal(
                rx, tid, DEADLINE_MS / 1000 + SLACK_S
            )

        assert [s.state for s in transfer("up-1", 8)] == ["DONE", "DONE"]
        dev = next(
            line.split(":")[1].strip().split("@")[0]
            for line in subprocess.run(
                ["ip", "-n", ns_a, "-o", "link"], capture_output=True, text=True, check=True
            ).stdout.splitlines()
            if "va" in line
        )
        _sh("ip", "-n", ns_a, "link", "set", dev, "down")
        t0 = time.monotonic()
        before = snapshot(rx.pool)
        s_tx, s_rx = transfer("down-1", 30)
        assert time.monotonic() - t0 <= DEADLINE_MS / 1000 + SLACK_S + 1
        assert (
            s_tx.state == "FAILED" and s_tx.error_code in ("DEADLINE_EXCEEDED", "UNAVAILABLE") and s_tx.error
        )
        assert (
            s_rx.state == "FAILED" and s_rx.error_code in ("DEADLINE_EXCEEDED", "UNAVAILABLE") and s_rx.error
        )
        _sh("ip", "-n", ns_a, "link", "set", dev, "up")
        time.sleep(1.0)
        assert_unchanged(rx.pool, before)  # nothing of the failed transfer landed, even late
        ok = transfer("up-2", 12)
        assert [s.state for s in ok] == ["DONE", "DONE"], ok
        assert np.array_equal(rx.pool.k(1)[:12], tx.pool.k(1)[:12])
        for svc in (stx, srx):
            eventually(lambda svc=svc: _settled(svc), 3 * IDLE_RETURN_S + 3, "settled")
    finally:
        for e in engines:
            e.stop()
        stx.stop()
        srx.stop()
