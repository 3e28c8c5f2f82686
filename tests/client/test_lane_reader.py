"""The SDK lane's reader thread parks while callers read the socket themselves (``_lane`` module
doc): a caller that waits while another thread reads still gets its message promptly, and an END
nobody waits for still reaches the book once the lane is quiet. Against a hand-driven lane
socket (the service's side of the wire format in ``lane_wire``)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvservice_client import _lane, lane_wire
from kvservice_client._transfer_stream import Ended


def end(tid: str, role: int = 0, bs: str = "b") -> bytes:
    t, b = tid.encode(), bs.encode()
    hdr = struct.pack("<6I4Q", lane_wire.MSG_END, role, 0, len(t), len(b), 0, 64, 1, 0, 5)
    return hdr + t + b + struct.pack("<I", 0)


def reply(seq: int) -> bytes:
    return struct.pack("<IIiI", lane_wire.MSG_REPLY, seq, lane_wire.ACCEPTED, 0)


class Service:
    """The service's end of one lane: accepts it, welcomes it, then sends what a test says."""

    def __init__(self, path: str) -> None:
        self.ls = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ls.bind(path)
        self.ls.listen(1)
        self.conn: socket.socket | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.conn, _ = self.ls.accept()
        lane_wire.parse_hello(self.conn.recv(65536))
        self.conn.send(lane_wire.welcome(True))

    def send(self, msg: bytes) -> None:
        assert self.conn is not None
        self.conn.send(msg)

    def seq_of_next_send(self) -> int:
        assert self.conn is not None
        return struct.unpack_from("<6I", self.conn.recv(65536))[1]

    def close(self) -> None:
        for s in (self.conn, self.ls):
            if s is not None:
                s.close()


@pytest.fixture
def lane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_lane.Lane, Ended, Service]]:
    monkeypatch.setattr(_lane, "_PARK_S", 5.0)  # a reader that parks stays parked for the test
    svc = Service(str(tmp_path / "s.lane"))
    book = Ended()
    ln = _lane.Lane(str(tmp_path / "s.lane"), "sess", book)
    book.pump, book.wake, book.waiting = ln.pump, ln.wake, ln.waiting
    yield ln, book, svc
    ln.close()
    svc.close()


def test_the_reader_leaves_an_end_to_callers_while_they_read(lane: tuple[_lane.Lane, Ended, Service]) -> None:
    ln, book, svc = lane
    book.made("t1", "RECEIVER", "b")
    threading.Timer(0.05, svc.send, (end("t1"),)).start()
    assert book.wait_all("t1", time.monotonic() + 2) is not None  # read on this thread
    time.sleep(0.05)  # (a reader that polled before the wait began settles)
    svc.send(end("t2"))  # nobody waits for it; the reader is parked: it stays in the socket
    time.sleep(0.2)
    assert ("t2", "RECEIVER", "b") not in book._ended
    book.made("t2", "RECEIVER", "b")  # the next wait reads it
    assert book.wait_all("t2", time.monotonic() + 2) is not None


def test_the_reader_drains_a_quiet_lane(
    lane: tuple[_lane.Lane, Ended, Service], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No caller read for _PARK_S: the reader takes what comes (an END nobody waits for yet)."""
    ln, book, svc = lane
    monkeypatch.setattr(_lane, "_PARK_S", 0.05)
    time.sleep(0.1)
    svc.send(end("t3"))
    for _ in range(200):
        if ("t3", "RECEIVER", "b") in book._ended:
            break
        time.sleep(0.01)
    assert ("t3", "RECEIVER", "b") in book._ended


def test_a_waiter_gets_its_end_after_the_thread_reading_left(lane: tuple[_lane.Lane, Ended, Service]) -> None:
    """Thread A reads the lane for its SEND's REPLY; B waits for t2 meanwhile (the book's
    condition: a REPLY wakes nobody there). A leaves with its REPLY, then t2 comes: the reader
    reads it for B, though a caller read a moment ago."""
    ln, book, svc = lane
    book.made("t2", "RECEIVER", "b")
    accepted: list[bool] = []
    a = threading.Thread(
        target=lambda: accepted.append(ln.send("t9", "a", np.arange(2, dtype=np.int64), 0, 2.0))
    )
    a.start()
    seq = svc.seq_of_next_send()  # A reads the lane for its REPLY
    got: list[float] = []
    b = threading.Thread(
        target=lambda: got.append(time.monotonic()) if book.wait_all("t2", time.monotonic() + 3) else None
    )
    b.start()
    time.sleep(0.05)
    svc.send(reply(seq))
    a.join(2)
    time.sleep(0.05)
    sent = time.monotonic()
    svc.send(end("t2"))
    b.join(4)
    assert accepted == [True] and got
    assert got[0] - sent < 1.0  # not the wait's deadline, nor the reader's 5 s park


def test_a_send_whose_reply_another_thread_would_read_gets_it(
    lane: tuple[_lane.Lane, Ended, Service],
) -> None:
    """A caller sends while another thread reads the lane; that thread leaves before the REPLY
    comes: the reader takes the REPLY, the send is accepted (not a fallback after its timeout)."""
    ln, book, svc = lane
    book.made("t1", "RECEIVER", "b")
    waiter = threading.Thread(target=book.wait_all, args=("t1", time.monotonic() + 2))
    waiter.start()
    time.sleep(0.05)  # it reads the lane
    accepted: list[bool] = []
    sender = threading.Thread(
        target=lambda: accepted.append(ln.send("t9", "a", np.arange(2, dtype=np.int64), 0, 2.0))
    )
    sender.start()
    seq = svc.seq_of_next_send()
    svc.send(end("t1"))  # the waiter leaves
    waiter.join(2)
    time.sleep(0.05)
    t0 = time.monotonic()
    svc.send(reply(seq))
    sender.join(3)
    assert accepted == [True] and time.monotonic() - t0 < 1.0
