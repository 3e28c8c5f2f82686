"""What the core's steps ask of the outside world, each with its two runnings side by side.

An effect is yielded by a call's steps (``_steps``) and run by the face: ``sync(face)`` on the
calling thread for :class:`~kvservice_client.Client`, ``await aio(face)`` for
:class:`~kvservice_client.AsyncClient`. This module and the faces' constructors are the only places
where the two clients differ; a call's logic is never here.

The face is read for: ``_stub`` (its KVService stub, sync or aio), ``_session`` (the
``SessionKeeper``), ``timeout``, ``_credential_path``, ``_tx_book`` (``Ended``), and on the sync
face ``_transfer_stream()``; the async face's ``session_id()``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from ._errors import DeadlineExceeded
from ._local_identity import fetch_credential_async
from ._session import fetch_credential
from ._transfer_stream import StreamBroken

__all__ = ["SESSION", "BookWait", "Credential", "LaneCall", "OnStream", "Read", "Sleep", "Unary"]


class Unary:
    """A unary RPC ``method`` of the stub: its response, or its grpc.RpcError thrown in."""

    __slots__ = ("method", "request", "kwargs")

    def __init__(self, method: str, request: Any, **kwargs: Any) -> None:
        self.method, self.request, self.kwargs = method, request, kwargs

    def sync(self, face: Any) -> Any:
        return getattr(face._stub, self.method)(self.request, **self.kwargs)

    async def aio(self, face: Any) -> Any:
        return await getattr(face._stub, self.method)(self.request, **self.kwargs)


class _Session:
    """The session id, the session opened (or a resume waited out) first; raises if lost."""

    def sync(self, face: Any) -> str:
        return face._session.current(face.timeout)  # type: ignore[no-any-return]

    async def aio(self, face: Any) -> str:
        return await face.session_id()  # type: ignore[no-any-return]


SESSION = _Session()


class Credential:
    """A fresh local credential from the service's credential socket ('' when there is none)."""

    def sync(self, face: Any) -> str:
        return fetch_credential(face._credential_path)

    async def aio(self, face: Any) -> str:
        return await fetch_credential_async(face._credential_path) if face._credential_path else ""


class Read:
    """The next message of a server stream ``call``; None at its end."""

    __slots__ = ("call",)

    def __init__(self, call: Any) -> None:
        self.call = call

    def sync(self, face: Any) -> Any:
        return next(self.call, None)

    async def aio(self, face: Any) -> Any:
        msg = await self.call.read()
        return None if msg is grpc.aio.EOF else msg


class Sleep:
    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def sync(self, face: Any) -> None:
        time.sleep(self.seconds)

    async def aio(self, face: Any) -> None:
        await asyncio.sleep(self.seconds)


class LaneCall:
    """A CALL on the lane (``Lane.call``): the serialized response, or None (make it over gRPC)."""

    __slots__ = ("lane", "args")

    def __init__(self, lane: Any, kind: int, request_id: str, body: bytes, timeout: float) -> None:
        self.lane, self.args = lane, (kind, request_id, body, timeout)

    def sync(self, face: Any) -> bytes | None:
        return self.lane.call(*self.args)  # type: ignore[no-any-return]

    async def aio(self, face: Any) -> bytes | None:
        return await self.lane.call_async(*self.args)  # type: ignore[no-any-return]


class OnStream:
    """A transfer call (``which``: its field in TransferCall) on the session's Transfers stream:
    the response, or None when the stream is not used or broke (then the steps make it unary).
    The async face holds no Transfers stream."""

    __slots__ = ("which", "method", "request", "request_id")

    def __init__(self, which: str, method: str, request: Any, request_id: str) -> None:
        self.which, self.method, self.request, self.request_id = which, method, request, request_id

    def sync(self, face: Any) -> Any:
        tx = face._transfer_stream()
        if tx is None:
            return None
        try:
            return tx.call(self.which, self.request, self.request_id, face.timeout)
        except StreamBroken:
            return None
        except TimeoutError:
            raise DeadlineExceeded(f"{self.method}: no answer within {face.timeout} s") from None

    async def aio(self, face: Any) -> Any:
        return None


class BookWait:
    """The ends of every side of ``transfer_id`` made on the Transfers stream or the lane
    (``Ended.wait_all``); None when the book cannot answer (then the steps watch). TimeoutError at
    ``deadline``. The async face always watches (its book gets no stream ends)."""

    __slots__ = ("transfer_id", "deadline")

    def __init__(self, transfer_id: str, deadline: float) -> None:
        self.transfer_id, self.deadline = transfer_id, deadline

    def sync(self, face: Any) -> Any:
        return face._tx_book.wait_all(self.transfer_id, self.deadline)

    async def aio(self, face: Any) -> Any:
        return None
