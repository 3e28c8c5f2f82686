"""The clients' lane (see :mod:`kvservice_client.lane_wire`): same-node SendDelta, ExpectDelta
and the END of this session's transfers without gRPC.

    send_delta   ─▶ Lane.send: SEND packet ─▶ waits for its REPLY (accepted | fallback)
    expect_delta ─▶ Lane.call: CALL packet ─▶ waits for its REPLY (the response | error | fallback)
                    (AsyncClient: Lane.call_async, the REPLY awaited on the loop)
    wait(transfer_id) ─▶ ``Ended`` book ─▶ Lane.pump until its END is in the book

Whoever waits reads the socket itself: a caller that finds nobody reading takes the read lock
and receives on its own thread until its REPLY (or, in ``wait``, any message: the book decides)
arrives, dispatching every message it reads (REPLYs to their callers' slots, ENDs to the book).
The reader thread reads only while no caller does, for ENDs nobody waits for yet. One thread
hand-off fewer each way, ~50-70 µs each on the GPU host.

Opened lazily by the client over a Unix socket target, at most once a second while the service
has none (it builds its native module in the background at start); any failure leaves the
client on gRPC. A lane whose socket breaks is dropped; the Transfers stream still reports every
END, so nothing waits forever on a lost packet.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import socket
import threading
import time
from typing import Any

import grpc
import numpy as np

from . import lane_wire
from ._errors import _BY_CODE, FailedPrecondition, InvalidArgument, ServerError
from ._types import TransferStatus

__all__ = ["Lane", "LaneOpener"]

_RETRY_S = 1.0


def _status(end: lane_wire.End) -> TransferStatus:
    role, ok, tid, bs, err, nbytes, pages, skipped, us, flags = end
    cross = bool(flags & lane_wire.END_CROSS)
    return TransferStatus.of_fields(
        {
            "transfer_id": tid,
            "role": "RECEIVER" if role == 0 else "SENDER",
            "buffer_set_id": bs,
            "state": "DONE" if ok else "FAILED",
            "bytes_sent": nbytes,
            "pages_sent": pages,
            "pages_skipped": skipped,
            "descriptors": 0,
            "chunks_done": 1,
            "senders_done": 1 if ok and role == 0 else 0,
            "path": "PACKED" if cross else "FUSED",
            "timings_us": {"wire": us, "total": us},
            "error_code": "" if ok else "INTERNAL",
            "error": err,
            "updated_unix_ms": int(time.time() * 1000),
            "route_note": "cross-node lane" if cross else "lane",
        }
    )


_MAX_ADVISED_SPIN_US = 100_000


def _advised_spin(value: Any) -> int:
    """A welcome's ``wait_spin_us`` (absent from older services: 0), at most 0.1 s."""
    return min(value, _MAX_ADVISED_SPIN_US) if isinstance(value, int) and value > 0 else 0


class _LoopEvent:
    """A REPLY slot's event for a caller on an event loop: ``set`` from any thread resolves
    ``future`` on its loop (a closed loop: nobody awaits it any more)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()

    def set(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._resolve)
        except RuntimeError:  # the loop is closed
            pass

    def _resolve(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class Lane:
    def __init__(
        self, path: str, session_id: str, book: Any, timeout: float = 2.0, spin_us: int | None = None
    ) -> None:
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
        self.cross = bool(w.get("cross"))  # the service's cross-node lane runs: SEND_TO elsewhere
        self.src_i64 = bool(w.get("src_i64"))  # it checks i64 source pages itself (lane_wire)
        self.chunks = bool(w.get("chunks"))  # it takes chunks with aux rows (FLAG_CHUNK)
        self.calls_served = frozenset(w.get("calls") or ())  # the CALLs it answers ("expect_delta")
        self.calls = 0  # CALLs answered here
        if spin_us is None:  # the engine set none: what the service advises (lane_wait_spin_us)
            spin_us = _advised_spin(w.get("wait_spin_us"))
        self.spin_us = max(0, spin_us)
        self._spin_s = self.spin_us * 1e-6
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._replies: dict[int, list[Any]] = {}  # seq -> [event, reply]
        self.closed = False
        self.sent = 0
        self._rlock = threading.Lock()  # held by the one thread that may receive (reader or caller)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # the book wakes a pump
        self._fds: tuple[int, ...] = (self._wake_r, self._wake_w)  # open until close()
        self._sock_fd = self.sock.fileno()
        self._poll_sock = select.poll()  # poll, not select: engines hold more than 1,024 fds
        self._poll_sock.register(self._sock_fd, select.POLLIN)
        self._poll_both = select.poll()
        self._poll_both.register(self._sock_fd, select.POLLIN)
        self._poll_both.register(self._wake_r, select.POLLIN)
        self._reader = threading.Thread(target=self._read, name="kvservice-lane", daemon=True)
        self._reader.start()

    def send(
        self,
        transfer_id: str,
        buffer_set_id: str,
        src: np.ndarray,
        flags: int,
        timeout: float,
        to: str = "",
        chunk: tuple[int, bool, dict[str, np.ndarray]] | None = None,
    ) -> bool:
        """True: the service took the chunk (the transfer's END follows its last); False: make
        the gRPC call. ``to``: another service's address (the cross-node lane's SEND_TO);
        ``chunk``: (offset, last, aux) of a chunk that is not the whole transfer. For a later
        chunk of a transfer the service has, raises InvalidArgument (a bad chunk: nothing
        changed) or FailedPrecondition (the transfer is over, or ends FAILED now)."""
        if self.closed:
            return False
        seq = next(self._seq)
        if to:
            msg = lane_wire.encode_send_to(seq, transfer_id, buffer_set_id, src, flags, to, chunk)
        else:
            msg = lane_wire.encode_send(seq, transfer_id, buffer_set_id, src, flags, chunk)
        if len(msg) > lane_wire.MAX_MESSAGE:
            return False
        reply = self._exchange(seq, msg, timeout)
        if reply is None:
            return False
        if reply[1] == lane_wire.INVALID:
            raise InvalidArgument(f"transfer_id {transfer_id!r}: {reply[2]}")
        if reply[1] == lane_wire.REFUSED:
            raise FailedPrecondition(f"transfer_id {transfer_id!r}: {reply[2]}")
        if reply[1] != lane_wire.ACCEPTED:
            return False
        self.sent += 1
        return True

    def call(self, kind: int, request_id: str, body: bytes, timeout: float) -> bytes | None:
        """A CALL (``calls`` lists it): the serialized response; None: make the call over gRPC
        with the same request id (fallback, no REPLY in time, a lost lane); raises the call's
        error (the KVClientError of its gRPC code)."""
        packet = self._call_packet(kind, request_id, body)
        return None if packet is None else self._answer(self._exchange(*packet, timeout))

    async def call_async(self, kind: int, request_id: str, body: bytes, timeout: float) -> bytes | None:
        """:meth:`call` for an event loop: the REPLY is awaited, never waited for on the loop's
        thread (the reader thread dispatches it: one hand-off to the loop)."""
        packet = self._call_packet(kind, request_id, body)
        if packet is None:
            return None
        seq, msg = packet
        done = _LoopEvent(asyncio.get_running_loop())
        slot = self._post(seq, msg, done)
        if slot is None:
            return None
        try:
            await asyncio.wait_for(done.future, timeout)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            with self._lock:
                self._replies.pop(seq, None)
            return None  # NOTE: as in _exchange: its gRPC twin with the same request id runs once
        return self._answer(slot[1])

    def _call_packet(self, kind: int, request_id: str, body: bytes) -> tuple[int, bytes] | None:
        if self.closed:
            return None
        seq = next(self._seq)
        msg = lane_wire.encode_call(seq, kind, request_id, body)
        return (seq, msg) if len(msg) <= lane_wire.MAX_MESSAGE else None

    def _answer(self, reply: lane_wire.Reply | None) -> bytes | None:
        """A CALL's REPLY: the response's bytes, None (make the call over gRPC) or the error raised."""
        if reply is None or reply[1] == lane_wire.FALLBACK:
            return None
        if reply[1] == lane_wire.CALL_ERROR:
            code, _, text = reply[2].partition("\n")
            status = getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)
            raise _BY_CODE.get(status, ServerError)(text or code, status)
        self.calls += 1
        return bytes(reply[3])

    def _post(self, seq: int, msg: bytes, event: Any) -> list[Any] | None:
        """Send ``msg`` with its REPLY's slot ``[event, reply]`` in place (None: the lane is gone)."""
        # the packet first: what follows overlaps the service's work (its REPLY waits for the
        # lock to be dispatched, so the slot is in place before it can be)
        slot: list[Any] | None
        with self._lock:
            try:
                self.sock.send(msg)
            except OSError:
                slot = None
            else:
                slot = [event, None]
                self._replies[seq] = slot
        if slot is None:
            self._drop()
        return slot

    def _exchange(self, seq: int, msg: bytes, timeout: float) -> lane_wire.Reply | None:
        """Send ``msg`` and wait for its REPLY (None: the lane is gone, or none in ``timeout``)."""
        slot = self._post(seq, msg, threading.Event())
        if slot is None:
            return None
        deadline = time.monotonic() + timeout
        if self._rlock.acquire(blocking=False):  # nobody reads: take the REPLY on this thread
            try:
                while not slot[0].is_set() and not self.closed:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._receive(left, False) is None:
                        break
            finally:
                self._rlock.release()
        if not slot[0].wait(max(0.0, deadline - time.monotonic())):
            with self._lock:
                self._replies.pop(seq, None)
            return None  # NOTE: the service may still run it; its gRPC twin is then refused (or replayed)
        return slot[1]  # type: ignore[no-any-return]

    def pump(self, timeout: float) -> bool:
        """Receive and dispatch on the calling thread until one message came, :meth:`wake` was
        called or ``timeout`` passed; False at once when another thread reads (or the lane is
        closed): the caller then waits on the book, which that reader feeds."""
        if self.closed or not self._rlock.acquire(blocking=False):
            return False
        try:
            if not self.closed:  # close() closes the fds with the read lock held
                self._receive(timeout, True)
        finally:
            self._rlock.release()
        return True

    def wake(self) -> None:
        """Make a :meth:`pump` in progress return (an END came another way: the Transfers stream)."""
        with self._lock:  # close() closes the pipe under it: never a write to a reused number
            if self._fds:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:  # full: a wake is pending anyway
                    pass

    def _receive(self, timeout: float, wakeable: bool) -> bool | None:
        """With the read lock held: wait up to ``timeout`` for a message and dispatch it. True: one
        was dispatched; False: none (timeout, woken, taken by nobody); None: the lane is gone.

        The first ``spin_us`` of a wait poll the socket without sleeping (each try releases the
        GIL): a thread asleep in poll wakes tens of µs after its packet on the GPU host."""
        if self._spin_s and timeout > 0:
            t0 = time.perf_counter()
            end = t0 + min(self._spin_s, timeout)
            while (got := self._take()) is False:
                if time.perf_counter() >= end:
                    timeout = max(0.0, timeout - (time.perf_counter() - t0))
                    break
            else:
                return got
        try:
            ready = {fd for fd, _ in (self._poll_both if wakeable else self._poll_sock).poll(timeout * 1000)}
        except (OSError, ValueError):  # closed meanwhile
            self._drop()
            return None
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except OSError:
                pass
        if self._sock_fd not in ready:
            return False
        return self._take()

    def _take(self) -> bool | None:
        """With the read lock held: dispatch one waiting message without blocking. True: done;
        False: none waiting; None: the lane is gone."""
        try:
            data = self.sock.recv(lane_wire.MAX_MESSAGE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._drop()
            return None
        self._dispatch(data)
        return True

    def _read(self) -> None:
        """The reader thread: waits for the socket without the read lock, reads with it."""
        poll = select.poll()  # its own: a poll object serves one thread at a time
        poll.register(self._sock_fd, select.POLLIN)
        while not self.closed:
            try:
                poll.poll()
            except (OSError, ValueError):
                break
            with self._rlock:
                if self._receive(0.0, False) is None:
                    return
        self._drop()

    def _dispatch(self, data: bytes) -> None:
        try:
            msg = lane_wire.decode(data)
        except ValueError:
            return
        if isinstance(msg, lane_wire.Reply):
            with self._lock:
                slot = self._replies.pop(msg[0], None)
            if slot is not None:
                slot[1] = msg
                slot[0].set()
        else:
            self.book.ended(_status(msg), from_lane=True)

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
        self.wake()
        if self._reader is not threading.current_thread():
            self._reader.join(2.0)  # it sees the shutdown; then nobody polls the fds we close
        with self._rlock, self._lock:  # a pumping caller finishes its poll first
            self.sock.close()
            fds, self._fds = self._fds, ()
            for fd in fds:  # once: a second close would close whatever reused the numbers
                os.close(fd)


class LaneOpener:
    """The client's lane, opened on first use and retried at most once a second."""

    def __init__(self, target: str, book: Any, enabled: bool, spin_us: int | None = None) -> None:
        self.spin_us = spin_us
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
                    self.lane = Lane(self.path, session_id, self.book, spin_us=self.spin_us)
                    self._session = session_id
                except (OSError, ValueError, PermissionError):
                    self.lane = None
            return self.lane

    def pump(self, timeout: float) -> bool:
        """The book's pump (``Ended.pump``): the open lane's, else False."""
        lane = self.lane
        return lane is not None and lane.pump(timeout)

    def wake(self) -> None:
        lane = self.lane
        if lane is not None:
            lane.wake()

    def close(self) -> None:
        with self._lock:
            if self.lane is not None:
                self._sent_before += self.lane.sent
                self.lane.close()
                self.lane = None
