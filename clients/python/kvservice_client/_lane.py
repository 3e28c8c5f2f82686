"""The sync client's lane (see :mod:`kvservice_client.lane_wire`): same-node SendDelta and the
END of this session's transfers without gRPC.

    send_delta ─▶ Lane.send: SEND packet ─▶ waits for its REPLY (accepted | fallback)
    reader thread ◀─ REPLY (wakes that caller) | END ─▶ ``Ended`` book ─▶ wait(transfer_id)

Opened lazily by the client over a Unix socket target, at most once a second while the service
has none (it builds its native module in the background at start); any failure leaves the
client on gRPC. A lane whose socket breaks is dropped; the Transfers stream still reports every
END, so nothing waits forever on a lost packet.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from typing import Any

import numpy as np

from . import lane_wire
from ._types import TransferStatus

__all__ = ["Lane", "LaneOpener"]

_RETRY_S = 1.0


def _status(end: lane_wire.End) -> TransferStatus:
    role, ok, tid, bs, err, nbytes, pages, skipped, us = end
    return TransferStatus(
        transfer_id=tid,
        role="RECEIVER" if role == 0 else "SENDER",
        buffer_set_id=bs,
        state="DONE" if ok else "FAILED",
        bytes_sent=nbytes,
        pages_sent=pages,
        pages_skipped=skipped,
        descriptors=0,
        chunks_done=1,
        senders_done=1 if ok and role == 0 else 0,
        path="FUSED",
        timings_us={"wire": us, "total": us},
        error_code="" if ok else "INTERNAL",
        error=err,
        updated_unix_ms=int(time.time() * 1000),
        route_note="lane",
    )


class Lane:
    def __init__(self, path: str, session_id: str, book: Any, timeout: float = 2.0) -> None:
        self.book = book
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
            self.sock.send(lane_wire.hello(session_id))
            w = lane_wire.parse_welcome(self.sock.recv(65536))
        except BaseException:
            self.sock.close()
            raise
        if not w.get("ok"):
            self.sock.close()
            raise PermissionError(f"lane refused: {w.get('error')}")
        self.sock.settimeout(None)
        self.self_addresses = frozenset(w.get("self_addresses") or ())
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._replies: dict[int, list[Any]] = {}  # seq -> [event, reply]
        self.closed = False
        self.sent = 0
        self._reader = threading.Thread(target=self._read, name="kvservice-lane", daemon=True)
        self._reader.start()

    def send(self, transfer_id: str, buffer_set_id: str, src: np.ndarray, flags: int, timeout: float) -> bool:
        """True: the service took the transfer (its END follows); False: make the gRPC call."""
        if self.closed:
            return False
        seq = next(self._seq)
        msg = lane_wire.encode_send(seq, transfer_id, buffer_set_id, src, flags)
        if len(msg) > lane_wire.MAX_MESSAGE:
            return False
        slot: list[Any] = [threading.Event(), None]
        with self._lock:
            self._replies[seq] = slot
        try:
            self.sock.send(msg)
        except OSError:
            self._drop()
            return False
        if not slot[0].wait(timeout):
            with self._lock:
                self._replies.pop(seq, None)
            return False  # NOTE: the service may still run it; its gRPC twin is then refused
        reply = slot[1]
        if reply is None or reply[1] != lane_wire.ACCEPTED:
            return False
        self.sent += 1
        return True

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(lane_wire.MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                self._drop()
                return
            try:
                msg = lane_wire.decode(data)
            except ValueError:
                continue
            if isinstance(msg, lane_wire.Reply):
                with self._lock:
                    slot = self._replies.pop(msg[0], None)
                if slot is not None:
                    slot[1] = msg
                    slot[0].set()
            else:
                self.book.ended(_status(msg))

    def _drop(self) -> None:
        self.closed = True
        with self._lock:
            slots, self._replies = list(self._replies.values()), {}
        for slot in slots:
            slot[0].set()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class LaneOpener:
    """The client's lane, opened on first use and retried at most once a second."""

    def __init__(self, target: str, book: Any, enabled: bool) -> None:
        self.path = lane_wire.lane_path(target.removeprefix("unix:")) if target.startswith("unix:") else ""
        self.book = book
        self.enabled = enabled and bool(self.path)
        self.lane: Lane | None = None
        self._session = ""
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._sent_before = 0  # by lanes closed since

    @property
    def sent(self) -> int:
        return self._sent_before + (self.lane.sent if self.lane is not None else 0)

    def get(self, session_id: str) -> Lane | None:
        if not self.enabled:
            return None
        lane = self.lane
        if lane is not None and not lane.closed and self._session == session_id:
            return lane
        with self._lock:
            if self.lane is not None and (self.lane.closed or self._session != session_id):
                self._sent_before += self.lane.sent
                self.lane.close()
                self.lane = None
            if self.lane is None and time.monotonic() >= self._next_try:
                self._next_try = time.monotonic() + _RETRY_S
                try:
                    self.lane, self._session = Lane(self.path, session_id, self.book), session_id
                except (OSError, ValueError, PermissionError):
                    self.lane = None
            return self.lane

    def close(self) -> None:
        with self._lock:
            if self.lane is not None:
                self._sent_before += self.lane.sent
                self.lane.close()
                self.lane = None
