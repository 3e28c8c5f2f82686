"""The sync client's half of the Transfers stream: one per session, opened on the first transfer call.

    expect_delta / send_delta / abort ─▶ TransferCall(call_id) ─▶ out queue ─▶ grpc's writer
    caller blocks on its call's slot   ◀─ reader thread ◀─ TransferEvent(call_id, answer | error)
    wait(transfer_id)                  ◀─ ``Ended`` book ◀─ TransferEvent(0, status): a side ended

A call whose answer the stream lost (it broke) raises :class:`StreamBroken`; the client then
makes it again as the unary call with the same request id, which the service runs once. After a
break the stream is opened anew on the next call, and the ended sides it may have missed are read
with a watch (``Ended.forget_all``), never guessed.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from ._errors import _BY_CODE, KVClientError, ServerError, map_rpc_error
from ._proto import kvservice_pb2 as pb
from ._types import TransferStatus

__all__ = ["Ended", "StreamBroken", "TransferStream"]

_END = object()
_KEEP_ENDED = 65_536  # ended sides remembered for a later wait(), oldest dropped first


class StreamBroken(Exception):
    """The stream ended before the call's answer came; the call may be made again by request id."""


def call_error(err: pb.CallError) -> KVClientError:
    code = getattr(grpc.StatusCode, err.code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, ServerError)(err.message or err.code, code)


class _Slot:
    __slots__ = ("event", "answer", "broken")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.answer: pb.TransferEvent | None = None
        self.broken = False


class Ended:
    """The sides of transfers this client made on the stream, and those that ended (thread-safe).

    ``wait_all(tid, sides)`` returns the statuses of every side in ``sides`` once all ended. A
    stream break loses events: ``forget_all`` marks what was made before it unreliable, so a
    waiter for it falls back to a watch, unless every end it needs is already in the book (an
    END the lane delivered before its service stopped is still the transfer's end).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # the lane's pump/wake (``_lane.LaneOpener``): a waiter reads the lane on its own thread
        self.pump: Callable[[float], bool] | None = None
        self.wake: Callable[[], None] | None = None
        self._pumping = 0  # waiters in pump(): an END from the stream must wake them
        self._ended: dict[tuple[str, str, str], TransferStatus] = {}
        self.sides: dict[str, set[tuple[str, str]]] = {}  # transfer id -> (role, buffer set)
        self._made_in: dict[str, int] = {}  # transfer id -> the epoch its sides were made in
        self._unsure: set[str] = set()  # transfer ids with a side made outside the stream
        self.epoch = 0  # bumped at each break: a wait that began before it cannot trust the book

    def made(self, transfer_id: str, role: str, buffer_set_id: str) -> None:
        with self._cond:
            self.sides.setdefault(transfer_id, set()).add((role, buffer_set_id))
            # NOTE: an END already here stays: it may have come before this call returned
            if self._made_in.get(transfer_id, self.epoch) != self.epoch:
                self._unsure.add(transfer_id)  # an older side of it may have lost its end
            self._made_in[transfer_id] = self.epoch
            if len(self.sides) > _KEEP_ENDED:  # never waited for: forget the oldest
                old = next(iter(self.sides))
                del self.sides[old]
                self._made_in.pop(old, None)

    def unsure(self, transfer_id: str) -> None:
        """A side of ``transfer_id`` was made by a unary call: waits for it use a watch."""
        with self._cond:
            self._unsure.add(transfer_id)
            if len(self._unsure) > _KEEP_ENDED:
                self._unsure.pop()

    def ended(self, st: TransferStatus, from_lane: bool = False) -> None:
        """``from_lane``: the thread reading the lane booked it (no pump to interrupt: it is one)."""
        with self._cond:
            self._ended[(st.transfer_id, st.role, st.buffer_set_id)] = st
            if len(self._ended) > _KEEP_ENDED:
                del self._ended[next(iter(self._ended))]
            self._notify(not from_lane)

    def _notify(self, wake: bool = True) -> None:  # with the condition held
        self._cond.notify_all()
        if wake and self._pumping and self.wake is not None:
            self.wake()

    def forget_all(self) -> None:
        """A stream break: ends of sides made so far may be lost (those already here are not)."""
        with self._cond:
            self.epoch += 1
            self._notify()

    def wait_all(self, transfer_id: str, deadline: float) -> list[TransferStatus] | None:
        """The ended statuses of every side made for ``transfer_id``; None when the book cannot
        answer (no side made here, or a break lost events); raises TimeoutError at ``deadline``."""
        with self._cond:
            while True:
                sides = self.sides.get(transfer_id)
                if not sides or transfer_id in self._unsure:  # a side made by a unary call
                    self._unsure.discard(transfer_id)
                    return None
                got = [self._ended.get((transfer_id, r, b)) for r, b in sides]
                if all(got):
                    for r, b in sides:
                        del self._ended[(transfer_id, r, b)]
                    del self.sides[transfer_id]
                    self._made_in.pop(transfer_id, None)
                    return [g for g in got if g is not None]
                if self._made_in.get(transfer_id) != self.epoch:
                    # a break since its sides were made: an end may be lost, the caller watches
                    self.sides.pop(transfer_id, None)
                    self._made_in.pop(transfer_id, None)
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if self.pump is not None and self._pump(left):
                    continue
                self._cond.wait(left)

    def _pump(self, left: float) -> bool:
        """With the condition held: read the lane on this thread for up to ``left`` (the condition
        released meanwhile); False when another thread reads it (then wait on the condition)."""
        assert self.pump is not None
        self._pumping += 1
        self._cond.release()
        try:
            return self.pump(left)
        finally:
            self._cond.acquire()
            self._pumping -= 1


class TransferStream:
    """One open Transfers stream (see the module doc); ``closed`` once it ended."""

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...], book: Ended) -> None:
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slots: dict[int, _Slot] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.book = book
        self.closed = False
        # an answer came: the service serves this stream and reports this session's ends on it
        # (it subscribes before it reads a call), so a side made another way (the lane) is seen
        self.answered = False
        self.error: KVClientError | None = None
        self._call = stub.Transfers(iter(self._out.get, _END), metadata=metadata)
        threading.Thread(target=self._read, name="kvservice-transfers", daemon=True).start()

    def call(self, which: str, request: Any, request_id: str, timeout: float) -> Any:
        """Send one call and wait for its answer (the response message); raises the call's error,
        StreamBroken, or TimeoutError."""
        slot = _Slot()
        with self._lock:
            if self.closed:
                raise StreamBroken
            call_id = next(self._ids)
            self._slots[call_id] = slot
        msg = pb.TransferCall(call_id=call_id, request_id=request_id)
        getattr(msg, which).CopyFrom(request)
        self._out.put(msg)
        if not slot.event.wait(timeout):
            with self._lock:
                self._slots.pop(call_id, None)
            raise TimeoutError
        if slot.broken or slot.answer is None:
            raise StreamBroken
        if slot.answer.HasField("error"):
            raise call_error(slot.answer.error)
        return getattr(slot.answer, which)

    def _read(self) -> None:
        try:
            for event in self._call:
                if event.call_id:
                    self.answered = True
                    with self._lock:
                        slot = self._slots.pop(event.call_id, None)
                    if slot is not None:
                        slot.answer = event
                        slot.event.set()
                elif event.HasField("status"):
                    self.book.ended(TransferStatus.from_proto(event.status))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = map_rpc_error(exc)
        finally:
            self._break()

    def _break(self) -> None:
        with self._lock:
            self.closed = True
            slots, self._slots = self._slots, {}
        self.book.forget_all()
        for slot in slots.values():
            slot.broken = True
            slot.event.set()

    def close(self) -> None:
        self._out.put(_END)
        self._call.cancel()
