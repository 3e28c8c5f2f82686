"""Exactly-once owned calls across a broken connection.

A call in flight when the connection breaks fails on the client with UNAVAILABLE, and the client
cannot tell whether the service ran it. So the client names each owned call with a request id
(``kvservice-request-id`` metadata, the same on every try) and tries again once the connection
is back; the service runs a request id once per session and answers every try with that one
outcome. The work itself runs as a task of its own, so a call whose caller went away mid-way
still finishes (half a registration is never left behind) and its retry gets the result::

    try 1 ──▶ run(task) ──▶ connection breaks, try 1 fails UNAVAILABLE on the client
    try 2 ──▶ same (session, request id) ──▶ await the same task ──▶ its response / its error

Outcomes are kept for ``TTL_S`` (longer than any client's call timeout) and at most ``CAPACITY``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from ..errors import InvalidArgument
from . import convert

__all__ = ["REQUEST_ID_METADATA_KEY", "ReplayCache", "replayable"]

REQUEST_ID_METADATA_KEY = "kvservice-request-id"
TTL_S = 300.0
CAPACITY = 65_536
_MAX_ID = 64
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


class ReplayCache:
    """(session id, request id) -> the task that runs that call (its outcome once it ended),
    oldest first, bounded."""

    def __init__(self, ttl_s: float = TTL_S, capacity: int = CAPACITY) -> None:
        self.ttl_s, self.capacity = ttl_s, capacity
        # the task while it runs; then its error, or its response as (message type name, bytes)
        self._tasks: collections.OrderedDict[tuple[str, str], tuple[float, Any]] = collections.OrderedDict()
        self.replays = 0
        self._types: dict[str, type[Message]] = {}  # response message types by full name

    def run(self, key: tuple[str, str], start: Callable[[], Awaitable[Any]]) -> asyncio.Future[Any]:
        self._expire()
        held = self._tasks.get(key)
        if held is not None:
            self.replays += 1
            return held[1] if isinstance(held[1], asyncio.Future) else _revive(held[1], self._types)
        task = asyncio.ensure_future(start())
        task.add_done_callback(functools.partial(self._settled, key))
        self._tasks[key] = (time.monotonic(), task)
        return task

    def _settled(self, key: tuple[str, str], task: asyncio.Future[Any]) -> None:
        """Keep the outcome, not the task: a finished task still holds its coroutine, context and
        response, objects the cyclic GC walks for each of up to CAPACITY calls; a response is
        kept as its bytes (none of them, once a retry comes, which is rare)."""
        _retrieve(task)
        held = self._tasks.get(key)
        if held is None or held[1] is not task or task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._tasks[key] = (held[0], exc)
            return
        result = task.result()
        if isinstance(result, Message):  # strings only: the tuple leaves the GC's scans
            name = type(result).DESCRIPTOR.full_name
            self._types.setdefault(name, type(result))
            self._tasks[key] = (held[0], (name, result.SerializeToString()))

    def _expire(self) -> None:
        old = time.monotonic() - self.ttl_s
        while self._tasks:
            key, (t, held) = next(iter(self._tasks.items()))
            if (t > old and len(self._tasks) <= self.capacity) or (
                isinstance(held, asyncio.Future) and not held.done()
            ):
                break
            del self._tasks[key]

    def __len__(self) -> int:
        return len(self._tasks)


def _revive(outcome: Any, types: dict[str, type[Message]]) -> asyncio.Future[Any]:
    """A settled future of a kept outcome (an error, or a response's type name and bytes)."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
        fut.exception()  # retrieved: the caller re-raises it
    else:
        fut.set_result(types[outcome[0]].FromString(outcome[1]))
    return fut


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # its error is re-raised to each try; never "exception never retrieved"


def replayable(fn: F) -> F:
    """Wrap a servicer method of an owned, unary call (inside ``grpc_errors``): a request id the
    session already used gets that call's outcome instead of a second run."""

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        rid = convert.metadata_value(context, REQUEST_ID_METADATA_KEY)
        session = convert.session_of(context)
        if not rid or not session:
            return await fn(self, request, context)
        if len(rid) > _MAX_ID:
            raise InvalidArgument(REQUEST_ID_METADATA_KEY, f"longer than {_MAX_ID} characters")
        task = self.replay.run((session, rid), lambda: fn(self, request, context))
        # NOTE: shielded: the caller going away (its RPC cancelled) must not cancel the work.
        return await asyncio.shield(task)

    return unary  # type: ignore[return-value]
