"""An engine's Transfers stream: its transfer calls in, their answers and its ended transfers out.

One stream per session, held open by the engine (DESIGN.md, data path v2 §5 and v3 §4)::

    engine ──TransferCall(call_id, expect_delta | send_delta | abort | claim)──▶ read loop ─▶ call
    engine ◀─TransferEvent(call_id, answer | error)──────────────────────── out queue ◀┘
    engine ◀─TransferEvent(0, status)─── TransferTable.subscribe(session): a side ended

Calls are run one after another in arrival order (an ExpectDelta answered before the SendDelta
sent after it is read), except Abort, which waits for the transfer to settle, and Claim, which
may wait for a landing to arrive: they run beside later calls. A call with a ``request_id`` goes
through the servicer's replay cache, so a call whose answer a broken stream lost can be made
again (here or unary) and runs once. Status
events are built from the record when it turns terminal (no snapshot, no watch per transfer).
A refused call is answered with a ``CallError`` carrying the status the unary call would have
ended with; the stream itself ends only when the engine closes it or breaks a rule of the
stream (``call_id`` 0, no call, a queue of unread events past ``MAX_QUEUED``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvservice_client.proto import kvservice_pb2 as pb

from ..errors import InvalidArgument, KVServiceError, ResourceExhausted
from ..transfer import trace
from ..transfer.records import Record
from . import convert
from .limits import CallLimits
from .replay import ReplayCache

if TYPE_CHECKING:
    from ..transfer.engine import TransferEngine

__all__ = ["MAX_QUEUED", "TransferStream"]

log = logging.getLogger(__name__)

MAX_QUEUED = 65_536  # unread events before the stream is ended (an engine that never reads)
_MAX_REQUEST_ID = 64
Handler = Callable[[Any, str], Awaitable[Any]]


class TransferStream:
    """Serve one Transfers stream of ``session_id`` (see the module doc)."""

    def __init__(
        self,
        session_id: str,
        engine: TransferEngine,
        replay: ReplayCache,
        expect: Handler,
        send: Handler,
        abort: Handler,
        limits: CallLimits | None = None,
        claim: Handler | None = None,
    ) -> None:
        self.session_id = session_id
        self.engine = engine
        self.replay = replay
        self._handlers: dict[str, Handler] = {"expect_delta": expect, "send_delta": send, "abort": abort}
        if claim is not None:
            self._handlers["claim"] = claim
        self._queue: asyncio.Queue[pb.TransferEvent | BaseException | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._aborts: set[asyncio.Task[None]] = set()
        self._limits = limits

    async def serve(self, calls: AsyncIterator[pb.TransferCall]) -> AsyncIterator[pb.TransferEvent]:
        unsubscribe = self.engine.table.subscribe(self.session_id, self._ended)
        reader = asyncio.ensure_future(self._read(calls))
        reader.add_done_callback(self._reader_done)
        try:
            while True:
                event = await self._queue.get()
                if event is None:
                    return
                if isinstance(event, BaseException):
                    raise event
                tid = _traced(event)
                if tid:
                    trace.mark(tid, f"{event.WhichOneof('event')}_yield")
                yield event
                if tid:
                    trace.mark(tid, f"{event.WhichOneof('event')}_written")
        finally:
            unsubscribe()
            reader.cancel()
            for task in self._aborts:
                task.cancel()

    def _reader_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self._queue.put_nowait(exc if exc is not None else None)

    def _put(self, event: pb.TransferEvent) -> None:
        if self._queue.qsize() >= MAX_QUEUED:
            self._queue.put_nowait(
                ResourceExhausted(f"Transfers stream: {MAX_QUEUED} events unread; the engine must read it")
            )
            return
        self._queue.put_nowait(event)

    def _ended(self, rec: Record) -> None:
        """A side of this session reached a terminal state (any thread): one status event."""
        if rec.lane_told and rec.state == "DONE":
            return  # its engine read this end on the lane already (kvservice.transfer.lane)
        event = pb.TransferEvent(status=convert.transfer_status(rec))
        trace.mark(rec.transfer_id, f"{rec.role}_event")
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._put(event)
        else:
            self._loop.call_soon_threadsafe(self._put, event)

    async def _read(self, calls: AsyncIterator[pb.TransferCall]) -> None:
        async for call in calls:
            which = call.WhichOneof("call")
            if not call.call_id:
                raise InvalidArgument("call_id", "must be non-zero (it names the call's answer)")
            if which is None:
                raise InvalidArgument("call", "one of expect_delta, send_delta, abort is required")
            if len(call.request_id) > _MAX_REQUEST_ID:
                self._put(
                    _error(call.call_id, InvalidArgument("request_id", f"longer than {_MAX_REQUEST_ID}"))
                )
                continue
            breach = self._limits.breach(getattr(call, which)) if self._limits is not None else None
            if breach:  # the per-call caps of unary calls (server/limits.py), answered the same way
                field, _, why = breach.partition(": ")
                self._put(_error(call.call_id, InvalidArgument(field, why)))
                continue
            if which not in self._handlers:
                self._put(_error(call.call_id, InvalidArgument("call", f"{which} is not served here")))
                continue
            if which in ("abort", "claim"):  # may wait (settle, landing): later calls do not wait for it
                task = asyncio.ensure_future(self._answer(call, which))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)
            else:
                await self._answer(call, which)

    async def _answer(self, call: pb.TransferCall, which: str) -> None:
        body, fn, sid = getattr(call, which), self._handlers[which], self.session_id
        try:
            if call.request_id:
                task = self.replay.run((sid, call.request_id), lambda: fn(body, sid))
                # NOTE: shielded: the stream ending must not cancel a call that already started.
                resp = await asyncio.shield(task)
            else:
                resp = await fn(body, sid)
        except KVServiceError as exc:
            self._put(_error(call.call_id, exc))
            return
        except Exception as exc:
            extra = {"transfer_id": getattr(body, "transfer_id", "")}
            log.exception("unhandled error in Transfers.%s", which, exc_info=exc, extra=extra)
            self._put(
                pb.TransferEvent(
                    call_id=call.call_id,
                    error=pb.CallError(code="INTERNAL", message=f"{which}: internal error; see server log"),
                )
            )
            return
        event = pb.TransferEvent(call_id=call.call_id)
        getattr(event, which).CopyFrom(resp)
        self._put(event)


def _traced(event: pb.TransferEvent) -> str:
    """The transfer id of an answer or status event when timeline points are on (trace.py)."""
    if not trace.enabled():
        return ""
    which = event.WhichOneof("event")
    if not which:
        return ""
    body = getattr(event, which)
    status = body.status if which in ("expect_delta", "send_delta") else body if which == "status" else None
    return status.transfer_id if status is not None else ""


def _error(call_id: int, exc: KVServiceError) -> pb.TransferEvent:
    return pb.TransferEvent(call_id=call_id, error=pb.CallError(code=exc.code.name, message=exc.message))
