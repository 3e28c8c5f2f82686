"""The cross-node lane's native half alone (two lanes in one process, host memory, NIXL over
UCX): what each engine reads on its lane when the path works, and when it fails on either side."""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import lane_wire

from tests.support.poll import eventually

pytest.importorskip("nixl")
R, P, PB = 4, 16, 1024  # regions, pages, bytes of a page region
NO_ROWS, NO_PAGES = np.zeros((0, 4), dtype=np.uint64), np.zeros(0, dtype=np.uint64)  # (no layout conversion)


class Pair:
    def __init__(self, pages: int = P) -> None:
        from kvservice.transfer.lane import native

        m = native.load()
        cap = native.nixl_capi_path()
        if cap is None:
            pytest.skip("no NIXL C API")
        self.tx, self.rx = m.Lane(), m.Lane()
        assert self.tx.init_nixl(cap, f"t-tx-{id(self)}"), self.tx.nixl_why()
        assert self.rx.init_nixl(cap, f"t-rx-{id(self)}"), self.rx.nixl_why()
        self.slot = self.rx.add_arena(-1, 1 << 20, 1 << 20)
        self.tx.add_arena(-1, 1 << 20, 1 << 20)
        self.rx_agent = self.tx.load_md(self.rx.local_md())
        self.tx_agent = self.rx.load_md(self.tx.local_md())
        rng = np.random.default_rng(1)
        self.a = rng.integers(0, 255, size=(R, pages, PB), dtype=np.uint8)
        self.b = rng.integers(0, 255, size=(R, pages, PB), dtype=np.uint8)
        self.b0 = self.b.copy()
        for lane, arr, bs, s in ((self.tx, self.a, "bsA", "sA"), (self.rx, self.b, "bsB", "sB")):
            table = np.array([[arr[r].ctypes.data, PB, PB] for r in range(R)], dtype=np.uint64)
            lane.add_pool(bs, s, -1, pages, 7, 0, table, 99)
        self.ea, sa = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.eb, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for e in (self.ea, self.eb):
            e.settimeout(10)
        self.tx.add_conn(sa.detach(), "sA")
        self.rx.add_conn(sb.detach(), "sB")

    def arm(
        self,
        tid: str,
        dst: list[int],
        prefix: int,
        *,
        raddr: int | None = None,
        rx: bool = True,
        slot_pages: int = 0,
        slot_at: int = 0,
    ) -> int:
        """Both lanes armed for ``tid``; the slot holds ``slot_pages`` pages (0: the delta), from
        ``slot_at`` bytes into the receiver's staging (as its allocator would place another)."""
        nbytes = len(dst) * R * PB
        slot = (slot_pages or len(dst)) * R * PB
        deadline = time.monotonic() + 10
        if rx:
            d = np.array(dst, dtype=np.int32)
            self.rx.arm_in(
                tid, 0, "sB", "bsB", self.tx_agent, prefix, d, self.slot + slot_at, slot, -1, deadline
            )
        addr = self.slot + slot_at if raddr is None else raddr
        self.tx.arm_out(
            tid, 0, "peerB", self.rx_agent, addr, slot, 0, 0, 99, prefix, len(dst), deadline, 0, 0, 0,
            NO_ROWS, NO_PAGES,
        )  # fmt: skip
        return nbytes

    def send(self, tid: str, src: list[int]) -> Any:
        t, b, a = tid.encode(), b"bsA", b"peerB"
        pages = np.array(src, dtype=np.int32)
        head = struct.pack("<7I", 4, 1, pages.size, len(t), len(b), 0, len(a))
        self.ea.send(head + t + b + a + pages.tobytes())
        return lane_wire.decode(self.ea.recv(65536))

    def sent_and_told(self, tid: str, src: list[int], nbytes: int) -> tuple[Any, Any]:
        """SEND_TO ``tid`` accepted; both engines' ENDs (receiver's, sender's), each told once,
        DONE with ``nbytes``."""
        assert self.send(tid, src)[1] == lane_wire.ACCEPTED
        rx = lane_wire.decode(self.eb.recv(65536))
        tx = lane_wire.decode(self.ea.recv(65536))
        assert rx[:2] == (0, True) and tx[:2] == (1, True), (rx, tx)
        assert rx[5] == tx[5] == nbytes
        return rx, tx

    def close(self) -> None:
        self.tx.stop()
        self.rx.stop()
        self.ea.close()
        self.eb.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _completions(lane: Any) -> list[Any]:
    """The receiving lane's next completions (what its engine is told), within 10 s."""
    return list(eventually(lane.drain, 10, "a completion", interval=0.005))


def test_written_unpacked_and_both_engines_told(pair: Pair) -> None:
    nbytes = pair.arm("t1", [2, 9, 11], prefix=1)
    rx, _ = pair.sent_and_told("t1", [3, 5, 7, 1], nbytes)
    assert rx[-1] & lane_wire.END_CROSS
    assert (pair.b[:, [2, 9, 11]] == pair.a[:, [5, 7, 1]]).all()
    others = [p for p in range(P) if p not in (2, 9, 11)]
    assert (pair.b[:, others] == pair.b0[:, others]).all()  # nothing outside the declared pages
    kinds = sorted(c[-1] for c in pair.tx.drain() + pair.rx.drain())
    assert kinds == [1, 2]
    assert pair.tx.take_trace() == [] and pair.rx.take_trace() == []  # tracing is off by default


def test_a_write_nixl_refuses_fails_both_sides_at_once(pair: Pair) -> None:
    pair.arm("bad", [4], prefix=0, raddr=pair.slot + (64 << 20))  # not registered at the receiver
    assert pair.send("bad", [6])[1] == lane_wire.ACCEPTED
    tx = lane_wire.decode(pair.ea.recv(65536))
    rx = lane_wire.decode(pair.eb.recv(65536))  # told by the sender, not by its deadline
    assert not tx[1] and "write failed" in tx[4], tx
    assert not rx[1] and "write failed" in rx[4], rx
    assert (pair.b == pair.b0).all()


def test_the_receiver_disarmed_first_nothing_lands(pair: Pair) -> None:
    pair.arm("gone", [4], prefix=0)
    assert pair.rx.disarm_in("gone", 0) == 1  # an Abort at the receiver
    assert pair.send("gone", [6])[1] == lane_wire.ACCEPTED
    tx = lane_wire.decode(pair.ea.recv(65536))
    assert not tx[1] and "not armed" in tx[4], tx
    assert (pair.b == pair.b0).all()
    assert pair.rx.disarm_in("gone", 0) == 0


def test_a_send_nobody_offered_falls_back(pair: Pair) -> None:
    reply = pair.send("never", [1])
    assert reply[1] == lane_wire.FALLBACK and "not offered" in reply[2], reply


def test_a_delta_larger_than_its_slot_streams_through_it(pair: Pair) -> None:
    """A 2-page slot and 11 pages: 11 one-page chunks through the slot's halves, each unpacked
    before its half is written again; both engines told once, byte exact."""
    dst, src = [0, 2, 3, 5, 6, 8, 9, 10, 12, 14, 15], [1, 4, 0, 2, 3, 5, 6, 7, 8, 9, 10, 11, 13]
    nbytes = pair.arm("big", dst, prefix=2, slot_pages=2)
    pair.sent_and_told("big", src, nbytes)
    assert (pair.b[:, dst] == pair.a[:, src[2:]]).all()
    others = [p for p in range(P) if p not in dst]
    assert (pair.b[:, others] == pair.b0[:, others]).all()
    done = {c[-1]: c for c in pair.tx.drain() + pair.rx.drain()}
    assert sorted(done) == [1, 2] and done[2][5] and done[2][7] == nbytes, done
    assert pair.rx.disarm_in("big", 0) == 2  # completed: not armed any more


@pytest.mark.parametrize("parts", [2, 3, 4, 8, 16])
def test_a_streamed_delta_keeps_parts_chunks_in_flight_and_never_overwrites_one_unread(
    pair: Pair, parts: int
) -> None:
    """lane_cross_parts: an 8-page slot in ``parts`` parts (8 at most: a part holds a page or
    more) and 15 pages; the receiver unpacks each chunk 2 ms late, so a sender that wrote a part
    again before its credit came would land the wrong bytes."""
    pair.tx.set_parts(parts)
    pair.rx.set_slow_unpack(2_000)
    dst, src = list(range(1, P)), [int(x) for x in np.random.default_rng(parts).permutation(P)[:15]]
    nbytes = pair.arm("parts", dst, prefix=0, slot_pages=8)
    pair.sent_and_told("parts", src, nbytes)
    assert (pair.b[:, dst] == pair.a[:, src]).all()
    assert (pair.b[:, 0] == pair.b0[:, 0]).all()


def test_a_streamed_delta_lands_exactly_and_its_chunks_are_timed() -> None:
    """60 pages through a 16-page slot in two parts (chunks of 8); each unpack held 1 ms, so a
    chunk written over an unread one would land wrong bytes. With tracing on, each side times
    every chunk, in order, its points never going back."""
    pair = Pair(pages=64)
    try:
        pair.tx.set_parts(2)
        pair.rx.set_slow_unpack(1_000)
        for lane in (pair.tx, pair.rx):
            lane.set_trace(True)
        dst = list(range(2, 62))
        src = [int(x) for x in np.random.default_rng(7).permutation(64)[:60]]
        nbytes = pair.arm("timed", dst, prefix=0, slot_pages=16)
        pair.sent_and_told("timed", src, nbytes)
        assert (pair.b[:, dst] == pair.a[:, src]).all()
        assert (pair.b[:, [0, 1, 62, 63]] == pair.b0[:, [0, 1, 62, 63]]).all()
        starts = list(range(0, 60, 8))
        deadline = time.monotonic() + 5
        rows: dict[int, list[Any]] = {0: [], 1: []}
        while len(rows[1]) < len(starts) and time.monotonic() < deadline:
            for lane in (pair.tx, pair.rx):
                for r in lane.take_trace():
                    rows[r[1]].append(r)
            time.sleep(0.01)
        for side in (0, 1):
            assert [r[2] for r in rows[side]] == starts, (side, rows[side])
            assert [r[3] for r in rows[side]] == [8] * 7 + [4]
            assert all(r[0] == "timed" and r[4] == r[3] * R * PB for r in rows[side])
            points = 5 if side == 0 else 4
            assert all(list(r[5][:points]) == sorted(r[5][:points]) and r[5][0] > 0 for r in rows[side])
        # the receiver read each chunk's note after the sender sent it, and unpacked it held 1 ms
        for tx, rx in zip(rows[0], rows[1], strict=True):
            assert rx[5][0] >= tx[5][3] and rx[5][2] - rx[5][1] >= 0
            assert rx[5][1] - rx[5][0] >= 0.001 * 0.9
    finally:
        pair.close()


def test_a_slot_smaller_than_two_pages_falls_back(pair: Pair) -> None:
    pair.arm("tiny", [1, 2, 3], prefix=0, slot_pages=1)
    reply = pair.send("tiny", [4, 5, 6])
    assert reply[1] == lane_wire.FALLBACK and "two pages" in reply[2], reply


def test_an_abort_during_a_chunks_unpack_cancels_after_it(pair: Pair) -> None:
    """The receiver ends a streamed transfer while its lane unpacks chunk 0 (held 200 ms): the
    disarm answers 2 (wait), the lane stops after that chunk with CANCELLED, tells the receiving
    engine nothing (the service books the abort), refuses the rest, and the sender fails."""
    dst = list(range(P))
    pair.rx.set_slow_unpack(200_000)
    pair.arm("cx", dst, prefix=0, slot_pages=2)
    assert pair.send("cx", dst)[1] == lane_wire.ACCEPTED
    # chunk 0's note arrived: its unpack is held (200 ms)
    eventually(lambda: pair.rx.stats()[4] != 0, 10, "chunk 0's note", interval=0.001)
    time.sleep(0.02)  # past the few µs between the note's arrival and its unpack being RUNNING
    assert pair.rx.disarm_in("cx", 0, cancel=True) == 2
    (c,) = _completions(pair.rx)
    assert not c[5] and c[6] == "cancelled by the receiving service" and not c[10], c
    tx = lane_wire.decode(pair.ea.recv(65536))
    assert not tx[1] and "cancelled" in tx[4], tx
    landed = [p for p in range(P) if not (pair.b[:, p] == pair.b0[:, p]).all()]
    assert landed == [0], landed  # chunk 0 (one page), nothing after it
    pair.eb.settimeout(0.2)
    with pytest.raises(TimeoutError):
        pair.eb.recv(65536)  # no END to the receiving engine


@pytest.mark.parametrize("delay_ms", [0.0, 15.0])
def test_the_receiver_ends_a_streamed_transfer_midway(pair: Pair, delay_ms: float) -> None:
    """Abort at the receiver while 16 one-page chunks stream (each unpack starts 3 ms late):
    disarmed (1) means no byte lands after that; a chunk being unpacked (2, cancel) ends the
    transfer after it with CANCELLED and no END to the receiving engine; the sender always ends,
    failed unless all was unpacked."""
    dst = list(range(P))
    pair.rx.set_slow_unpack(3000)
    pair.arm("mid", dst, prefix=0, slot_pages=2)
    assert pair.send("mid", list(reversed(dst)))[1] == lane_wire.ACCEPTED
    time.sleep(delay_ms / 1000)
    got = pair.rx.disarm_in("mid", 0, cancel=True)
    after = pair.b.copy()
    tx = lane_wire.decode(pair.ea.recv(65536))
    time.sleep(0.05)
    rx_done = _completions(pair.rx) if got == 2 else []
    if got == 1:  # disarmed between chunks: nothing lands from now on
        assert not tx[1], tx
        assert (pair.b == after).all()
        assert pair.rx.drain() == []
    else:
        assert got == 2, got
        (c,) = rx_done
        if c[5]:  # all chunks were in: an ordinary DONE
            assert tx[1] and (pair.b[:, dst] == pair.a[:, list(reversed(dst))]).all()
        else:  # the service's Abort returns after this completion: nothing lands after it
            assert c[6] == "cancelled by the receiving service" and not c[10], c  # engine not told
            assert not tx[1], tx
            settled = pair.b.copy()
            time.sleep(0.05)
            assert (pair.b == settled).all()
    print("outcome", got, tx[1], rx_done and rx_done[0][6])


def test_a_small_send_is_not_held_up_behind_a_streaming_one(pair: Pair) -> None:
    """A streamed send (11 one-page chunks through a 2-page slot, each unpack held 40 ms: ~0.5 s)
    runs on the sender's bulk thread; a one-page send accepted meanwhile is packed and written on
    the lane thread and ends first (it used to wait on the lane thread for the whole stream)."""
    pair.rx.set_slow_unpack(40_000)
    big = list(range(11))
    pair.arm("big", big, prefix=0, slot_pages=2)
    pair.arm("small", [13], prefix=0, slot_at=4 * R * PB)  # a slot beside the big one's
    assert pair.send("big", big)[1] == lane_wire.ACCEPTED
    time.sleep(0.1)  # the big one is streaming: chunk 0 or 1 is being unpacked
    assert pair.send("small", [14])[1] == lane_wire.ACCEPTED
    ends = [lane_wire.decode(pair.ea.recv(65536)) for _ in range(2)]
    assert [e[2] for e in ends] == ["small", "big"], ends
    assert all(e[1] for e in ends), ends
    assert (pair.b[:, 13] == pair.a[:, 14]).all(), "small"
    assert (pair.b[:, big] == pair.a[:, big]).all(), [
        p for p in big if not (pair.b[:, p] == pair.a[:, p]).all()
    ]


def test_the_chunks_timeline_is_logged_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    """CrossBook.log_trace: one "lane chunk" DEBUG line per timed chunk (what bench_transfer
    --timeline reads); nothing is taken from the lane when DEBUG is off."""
    from kvservice.transfer.lane.cross import CrossBook

    class Native:
        def __init__(self) -> None:
            self.rows = [
                ("t", 0, 0, 2, 2048, (1.0, 2.0, 3.0, 4.0, 5.0)),
                ("t", 1, 0, 2, 2048, (4.5, 5, 6, 7, 0)),
            ]

        def take_trace(self) -> list[Any]:
            rows, self.rows = self.rows, []
            return rows

    book = CrossBook.__new__(CrossBook)
    book.n = Native()
    with caplog.at_level(logging.INFO, logger="kvservice.transfer.lane.cross"):
        book.log_trace()
    assert not caplog.records and len(book.n.rows) == 2
    with caplog.at_level(logging.DEBUG, logger="kvservice.transfer.lane.cross"):
        book.log_trace()
    got = [(r.side, r.first, r.bytes, r.t) for r in caplog.records if r.getMessage() == "lane chunk"]
    assert got == [("send", 0, 2048, [1.0, 2.0, 3.0, 4.0, 5.0]), ("recv", 0, 2048, [4.5, 5, 6, 7])]


def test_a_spinning_bulk_thread_takes_streams_and_stops_at_once() -> None:
    """lane_spin_us on (the GPU default): the bulk thread polls after an offer and after each
    job; streamed sends still land exactly, and stop() returns while it is polling."""
    pair = Pair(pages=64)
    try:
        pair.tx.set_spin_us(3_000_000)  # polls 3 s after each offer / job
        pair.tx.set_parts(2)
        for n, tid in enumerate(("s1", "s2")):
            dst = list(range(2 + n, 50 + n))
            src = [int(x) for x in np.random.default_rng(n).permutation(64)[:48]]
            nbytes = pair.arm(tid, dst, prefix=0, slot_pages=16)
            pair.sent_and_told(tid, src, nbytes)
            assert (pair.b[:, dst] == pair.a[:, src]).all()
        t0 = time.monotonic()
        pair.tx.stop()  # within the spin window
        assert time.monotonic() - t0 < 1.0  # not the spin's 3 s
    finally:
        pair.close()
