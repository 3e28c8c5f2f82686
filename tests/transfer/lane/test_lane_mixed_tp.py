"""Mixed TP on the native lane (CPU: shm pools, memcpy in the native thread): one service, sender
ranks of one TP size, receiver ranks of another; each SEND copies its head slice into every
receiver rank that holds those heads, and a receiver rank ends when its last sender did::

    H = 4, TP 4 -> 2:  sender s holds head s;  receiver 0 holds heads 0-1 (senders 0, 1),
                       receiver 1 holds heads 2-3 (senders 2, 3): two SENDs per receiver rank
    H = 4, TP 1 -> 2:  the one sender's SEND writes heads 0-1 to receiver 0, 2-3 to receiver 1
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from kvservice_client import Client, Layout, ShmKVPool
from kvservice_client._errors import KVClientError

from tests.support.lane import lane_of
from tests.support.poll import eventually

PAGES = 24
SRC = [5, 9, 2, 11, 20, 3, 14, 7]
PREFIX = 3
DST = [1, 0, 22, 13, 6]


def layout(heads: int, tp: int, rank: int, page_layout: str = "nhd", head_dim: int = 8) -> Layout:
    return Layout.mha(
        num_layers=2,
        page_size=4,
        num_pages=PAGES,
        total_kv_heads=heads,
        head_dim=head_dim,
        dtype="float16",
        tp_size=tp,
        tp_rank=rank,
        page_layout=page_layout,  # type: ignore[arg-type]
    )


def regions(pool: ShmKVPool) -> list[np.ndarray]:
    lay = pool.layout
    return [pool.k(i) for i in range(lay.num_layers)] + [pool.v(i) for i in range(lay.num_layers)]


def heads_of(region: np.ndarray, lay: Layout) -> np.ndarray:
    """``[pages, page_size, local heads, head bytes]`` view of one region, either page layout."""
    hb = lay.head_dim_k * lay.itemsize
    if lay.page_layout == "hnd":
        return region.reshape(lay.num_pages, lay.local_kv_heads, lay.page_size, hb).transpose(0, 2, 1, 3)
    return region.reshape(lay.num_pages, lay.page_size, lay.local_kv_heads, hb)


class Ranks:
    """Sender ranks (TP p) and receiver ranks (TP d) of one service, each its own engine."""

    def __init__(self, server: Any, heads: int, p: int, d: int, address: str = "", **kw: Any) -> None:
        """``server``: an in-process service (its lane is checked), or None with ``address``: a
        service process (both its address and the SendDelta target)."""
        self.heads = heads
        self.address = address or server.address
        self.peer = address or server.app.peer_address
        self.lane = lane_of(server) if server is not None else None
        one = layout(heads, 1, 0, **kw)
        rng = np.random.default_rng(11)
        hb = one.head_dim_k * one.itemsize
        shape = (PAGES, one.page_size, heads, hb)
        self.glob = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(4)]
        self.tx = [self._rank(p, r, kw) for r in range(p)]
        self.rx = [self._rank(d, r, kw) for r in range(d)]
        for _, pool, _ in self.tx:
            for g, reg in zip(self.glob, regions(pool), strict=True):
                heads_of(reg, pool.layout)[:] = g[:, :, self.held(pool.layout), :]
        for i, (_, pool, _) in enumerate(self.rx):
            for reg in regions(pool):
                reg[:] = np.random.default_rng(100 + i).integers(0, 256, reg.shape, dtype=np.uint8)
        self.before = [[r.copy() for r in regions(pool)] for _, pool, _ in self.rx]

    def _rank(self, tp: int, rank: int, kw: dict[str, Any]) -> tuple[Client, ShmKVPool, str]:
        lay = layout(self.heads, tp, rank, **kw)
        pool = ShmKVPool.create(lay)
        kv = Client(self.address, client_name=f"tp{tp}-{rank}")
        bs = kv.register_buffers(lay, pool.k_regions, pool.v_regions).buffer_set_id
        return kv, pool, bs

    @staticmethod
    def held(lay: Layout) -> np.ndarray:
        """Global heads of a rank (one replicated head when TP exceeds the heads)."""
        if lay.tp_size > lay.total_kv_heads:
            return np.array([lay.tp_rank * lay.total_kv_heads // lay.tp_size])
        n = lay.local_kv_heads
        return np.arange(lay.tp_rank * n, (lay.tp_rank + 1) * n)

    def expect(self, tid: str, ranks: list[int] | None = None, **kw: Any) -> None:
        for r in range(len(self.rx)) if ranks is None else ranks:
            kv, _, bs = self.rx[r]
            kv.expect_delta(tid, bs, prefix_pages=PREFIX, dst_page_indices=DST, **kw)

    def send(self, tid: str, ranks: list[int] | None = None) -> list[Any]:
        return [
            self.tx[s][0].send_delta(tid, self.tx[s][2], src_page_indices=SRC, peer_address=self.peer)
            for s in (range(len(self.tx)) if ranks is None else ranks)
        ]

    def check_rank(self, r: int) -> None:
        """Receiver rank ``r`` holds its heads of the delta's source pages, and nothing else moved."""
        _, pool, _ = self.rx[r]
        lay = pool.layout
        for i, reg in enumerate(regions(pool)):
            got = heads_of(reg, lay)[DST]
            want = self.glob[i][SRC[PREFIX:]][:, :, self.held(lay), :]
            assert np.array_equal(got, want), f"receiver rank {r}, region {i}: wrong bytes"
            other = np.setdiff1d(np.arange(PAGES), DST)
            assert np.array_equal(reg[other], self.before[r][i][other]), f"rank {r}: a page outside DST moved"

    def check_receivers_rank0_on_the_lane(self, tid: str) -> None:
        """Two receiver ranks DONE, rank 0 by the lane and rank 1 not, each byte exact."""
        (r0,) = self.rx[0][0].wait(tid, timeout=10)
        (r1,) = self.rx[1][0].wait(tid, timeout=10)
        assert r0.state == r1.state == "DONE", (r0, r1)
        assert r0.route_note == "lane" and r1.route_note != "lane", (r0, r1)
        for r in (0, 1):
            self.check_rank(r)

    def check_senders_done(self, tid: str) -> None:
        for kv, _, _ in self.tx:
            (st,) = kv.wait(tid, timeout=10)
            assert st.state == "DONE", st

    def close(self) -> None:
        for kv, pool, _ in self.tx + self.rx:
            kv.close()
            pool.close()


@pytest.fixture
def server(make_server: Any) -> Any:
    return make_server(transport="loopback")


CASES = [
    pytest.param(4, 4, 2, {}, id="H4-tp4to2"),
    pytest.param(4, 2, 1, {}, id="H4-tp2to1"),
    pytest.param(4, 1, 2, {}, id="H4-tp1to2"),
    pytest.param(8, 2, 4, {}, id="H8-tp2to4"),
    pytest.param(4, 4, 2, {"page_layout": "hnd"}, id="H4-tp4to2-hnd"),
    pytest.param(4, 2, 4, {"head_dim": 3}, id="H4-tp2to4-unaligned"),
]


@pytest.mark.parametrize("heads,p,d,kw", CASES)
@pytest.mark.parametrize("expected", [0, None], ids=["derived", "declared"])
def test_mixed_tp_goes_over_the_lane_byte_exact(
    server: Any, heads: int, p: int, d: int, kw: dict[str, Any], expected: int | None
) -> None:
    """Every sender rank's SEND is taken by the lane; each receiver rank ends DONE over the lane
    holding exactly its heads; Python books every copy and nothing stays armed or live."""
    t = Ranks(server, heads, p, d, **kw)
    try:
        senders = max(1, p // d) if expected is None else 0
        t.expect("mtp", expected_senders=senders)
        t.send("mtp")
        for r, (kv, _, _) in enumerate(t.rx):
            (st,) = kv.wait("mtp", timeout=10)
            assert st.state == "DONE" and st.route_note == "lane", st
            t.check_rank(r)
        for kv, _, _ in t.tx:
            (st,) = kv.wait("mtp", timeout=10)
            assert st.state == "DONE" and st.route_note == "lane", st
        assert sum(kv.lane_sent for kv, _, _ in t.tx) == p
        assert t.lane is not None
        book = t.lane.book
        eventually(lambda: book.sent == p, 10, "every SEND booked")
        assert book.n.armed_count() == 0
        polled = [x for kv, _, _ in t.rx for x in kv.poll(["mtp"])]
        assert [x.state for x in polled] == ["DONE"] * d
        delta = len(SRC) - PREFIX
        assert all(x.pages_sent == delta for x in polled), polled
        eventually(lambda: server.node.transfers.table.live() == [], 10, "nothing live")
    finally:
        t.close()


def test_a_receiver_rank_hears_done_only_after_its_last_sender(server: Any) -> None:
    """TP 4 -> 2: one of receiver 0's two senders copied; it is not DONE until the other did."""
    t = Ranks(server, 4, 4, 2)
    try:
        t.expect("half")
        t.send("half", [0])
        time.sleep(0.3)
        assert t.rx[0][0].poll(["half"])[0].state != "DONE"
        t.send("half", [1, 2, 3])
        for r in (0, 1):
            (st,) = t.rx[r][0].wait("half", timeout=10)
            assert st.state == "DONE" and st.route_note == "lane", st
            t.check_rank(r)
    finally:
        t.close()


def test_abort_between_senders_leaves_later_senders_out(server: Any) -> None:
    """TP 4 -> 2: receiver 1's first sender copied, then an Abort: receiver 1 ends ABORTED, its
    second sender is refused, and no byte lands in receiver 1 after the Abort returned."""
    t = Ranks(server, 4, 4, 2)
    try:
        t.expect("ab")
        t.send("ab", [0, 1, 2])
        (st,) = t.rx[0][0].wait("ab", timeout=10)
        assert st.state == "DONE"
        book = t.lane.book  # type: ignore[union-attr]
        eventually(lambda: book.sent == 3, 10, "the three copies booked")
        t.rx[1][0].abort("ab", reason="test")
        snap = [r.copy() for r in regions(t.rx[1][1])]
        try:
            t.send("ab", [3])
            (st,) = t.tx[3][0].wait("ab", timeout=10)
            assert st.state in ("ABORTED", "FAILED") and st.route_note != "lane", st
        except KVClientError:
            pass  # refused at once: as good
        assert all(np.array_equal(a, b) for a, b in zip(regions(t.rx[1][1]), snap, strict=True))
        (rst,) = t.rx[1][0].wait("ab", timeout=10)
        assert rst.state == "ABORTED", rst
        eventually(lambda: book.n.armed_count() == 0, 10, "nothing armed")
    finally:
        t.close()


def test_a_sender_whose_heads_are_not_all_armed_goes_over_grpc(server: Any) -> None:
    """TP 1 -> 2 with only receiver rank 0 declared when the sender sends: the lane refuses (it
    would leave rank 1 without its heads); the gRPC route completes once rank 1 declares."""
    t = Ranks(server, 4, 1, 2)
    try:
        t.expect("part", [0])
        kv, _, bs = t.tx[0]
        kv.send_delta("part", bs, src_page_indices=SRC, peer_address=server.app.peer_address)
        assert kv.lane_sent == 0
        t.expect("part", [1])
        for r in (0, 1):
            (st,) = t.rx[r][0].wait("part", timeout=10)
            assert st.state == "DONE" and st.route_note != "lane", st
            t.check_rank(r)
    finally:
        t.close()


def test_a_sender_over_grpc_leaves_the_other_ranks_on_the_lane(server: Any) -> None:
    """TP 4 -> 2: senders 0 and 1 take the lane (receiver 0), sender 2 goes over gRPC ("packed"):
    that gates only receiver 1, receiver 0 stays the lane's. It used to disarm every rank, or
    refuse sender 2 while a lane copy into a rank was pending."""
    t = Ranks(server, 4, 4, 2)
    try:
        t.expect("mix")
        t.send("mix", [0, 1])
        kv, _, bs = t.tx[2]
        kv.send_delta("mix", bs, src_page_indices=SRC, peer_address=t.peer, path="packed")
        t.send("mix", [3])
        t.check_receivers_rank0_on_the_lane("mix")
        # sender 3 took the lane when it came before sender 2's gate (then sender 2 waited for
        # its booking and went over gRPC), else gRPC: either way receiver 1 ends DONE
        assert [kv.lane_sent for kv, _, _ in t.tx][:3] == [1, 1, 0]
        t.check_senders_done("mix")
    finally:
        t.close()


@pytest.mark.parametrize("lane_first", [True, False], ids=["lane-first", "grpc-first"])
def test_a_replica_over_grpc_leaves_the_rank_another_replica_sends_on_the_lane(
    server: Any, lane_first: bool
) -> None:
    """Replicated heads (as MLA), TP 2 -> 2: receiver r is served by sender r alone. Sender 0 on
    the lane and sender 1 over gRPC (its SEND came before its receiver rank was armed, say):
    sender 1 gates only receiver 1. It used to refuse sender 1 because the lane was moving
    receiver 0, which sender 1 never writes (a real vLLM MLA pair under load failed so)."""
    t = Ranks(server, 1, 2, 2)
    try:
        t.expect("rep")
        kv, _, bs = t.tx[1]
        if lane_first:
            t.send("rep", [0])
        kv.send_delta("rep", bs, src_page_indices=SRC, peer_address=t.peer, path="packed")
        if not lane_first:
            t.send("rep", [0])
        t.check_receivers_rank0_on_the_lane("rep")
        t.check_senders_done("rep")
    finally:
        t.close()


@pytest.mark.parametrize(
    "heads,p,d",
    [
        pytest.param(2, 4, 2, id="H2-tp4to2-replicated"),  # two replicas of each head: no head geometry
        # 4 heads a sender rank, 6 a receiver rank: receiver 0 takes heads 4-5 of sender 1's four
        pytest.param(12, 3, 2, id="H12-tp3to2-not-nested"),
    ],
)
def test_mixed_tp_the_lane_cannot_split_stays_on_grpc(server: Any, heads: int, p: int, d: int) -> None:
    """Replicated heads, or TP sizes whose heads per rank do not nest: the lane refuses every SEND
    (no receiver rank hears DONE before all its heads came); the gRPC route moves them."""
    t = Ranks(server, heads, p, d)
    try:
        t.expect("grpc")
        t.send("grpc")
        for r in range(d):
            (st,) = t.rx[r][0].wait("grpc", timeout=10)
            assert st.state == "DONE" and st.route_note != "lane", st
            t.check_rank(r)
        assert sum(kv.lane_sent for kv, _, _ in t.tx) == 0
    finally:
        t.close()


def test_ends_the_lane_delivered_survive_the_service_stopping() -> None:
    """TP 4 -> 2 over the lane of a service process, then SIGTERM: every rank heard its END on
    the lane before the service went, and its wait returns DONE (a Transfers stream break keeps
    the ends already in the client's book; it used to drop them and raise SessionLost)."""
    import os
    import signal

    from tests.support.services import ServiceProc

    svc = ServiceProc("lane-stop")
    try:
        svc.wait_ready()
        eventually(lambda: os.path.exists(svc.sock + ".lane"), 120, "the lane is up")

        t = Ranks(None, 4, 4, 2, address=svc.address)
        try:
            t.expect("stop", deadline_ms=20_000)
            t.send("stop")
            assert sum(kv.lane_sent for kv, _, _ in t.tx) == 4
            time.sleep(0.2)  # the ENDs reach the engines' lane readers
            svc.signal(signal.SIGTERM)
            svc.proc.wait(30)
            for kv, _, _ in t.rx:
                (st,) = kv.wait("stop", timeout=10)
                assert st.state == "DONE" and st.route_note == "lane", st
        finally:
            t.close()
    finally:
        svc.stop()
