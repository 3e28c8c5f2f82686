"""asyncio client (grpc.aio): the awaited face over the SDK's core (``_calls``, ``_landing``; see
``_steps``): the same methods, arguments and results as :class:`~kvservice_client.Client`.

Differences, all in how calls run: no Transfers stream (transfer calls are unary whatever
``transfer_stream`` says, and ``wait`` watches), and the session stream is held by the same
``SessionKeeper`` thread as the sync client's, over a small blocking channel of its own; calls go
on the asyncio channel.
"""

from __future__ import annotations

import asyncio

from ._calls import Connecting
from ._client import channel_options
from ._errors import SessionLost
from ._landing import LandingCalls
from ._proto import kvservice_pb2_grpc
from ._session import SessionKeeper
from ._steps import AsyncFace

__all__ = ["AsyncClient"]


class AsyncClient(AsyncFace, LandingCalls):
    """Non-blocking client; use ``async with AsyncClient(target) as kv``.

    Sessions behave as in :class:`Client`: resumed after a broken stream, :class:`SessionLost`
    (also passed to ``on_session_lost``, on the client's event loop; it may be a coroutine
    function) once they cannot be.
    """

    def _connect(self, how: Connecting) -> None:
        options = channel_options(keepalive=how.keepalive)
        self._channel = how.security.aio_channel(self.target, options)
        self._stub = kvservice_pb2_grpc.KVServiceStub(self._channel)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_session_lost = how.on_session_lost
        self._session_channel = how.security.channel(self.target, options)
        self._session = SessionKeeper(
            kvservice_pb2_grpc.KVServiceStub(self._session_channel),
            self.client_name,
            self.target,
            self.owned,
            self._lost if how.on_session_lost is not None else None,
            self._credential_path,
        )

    async def session_id(self) -> str:
        """Open the session if needed (or wait out a resume) and return its id."""
        sid = self._session.ready_id()
        if sid:
            return sid
        self._loop = asyncio.get_running_loop()
        return await asyncio.to_thread(self._session.current, self.timeout)

    async def service_peer_address(self) -> str:
        """The address other kvservices reach the service at; see
        :attr:`Client.service_peer_address` (opens the session if needed; "" from older services).
        """
        await self.session_id()
        return self._session.peer_address

    def _lost(self, err: SessionLost) -> None:
        """On the keeper's thread: hand the loss to ``on_session_lost`` on the client's loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._tell_lost, err)

    def _tell_lost(self, err: SessionLost) -> None:
        assert self._on_session_lost is not None
        result = self._on_session_lost(err)
        if asyncio.iscoroutine(result):
            asyncio.get_running_loop().create_task(result)

    async def close(self) -> None:
        self._lane.close()
        await asyncio.to_thread(self._session.close, min(self.timeout, 5.0))
        self._session_channel.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
