"""An :class:`AsyncClient` on an event-loop thread of its own, for engine threads that must not block.

Engine adapters (vLLM connector, SGLang backend) start transfers from a scheduler or model-runner
thread and look at their outcome later; every RPC runs here, off that thread::

    fut = bg.transfer("room-7", lambda kv: kv.send_delta(...), deadline_ms=30_000)
    ...                                  # the engine thread goes on
    if fut.done(): status = fut.result()  # the terminal TransferStatus (or the client error)

A transfer's end comes from one WatchTransfers stream of the session, with a poll each second as a
backstop (an event sent before the stream was open is not replayed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ._aio import AsyncClient
from ._errors import KVClientError
from ._security import PLAIN, ChannelSecurity
from ._types import TransferStatus

__all__ = ["BackgroundClient"]

T = TypeVar("T")
_SAFETY_S = 5.0  # past a transfer's deadline, stop waiting for the service's word


class BackgroundClient:
    def __init__(
        self, target: str, *, client_name: str = "", timeout: float = 10.0, security: ChannelSecurity = PLAIN
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvservice-client", daemon=True)
        self._thread.start()
        self._waiters: dict[str, asyncio.Future[TransferStatus]] = {}
        self.kv: AsyncClient = self.call(self._open(target, client_name, timeout, security), timeout + 5)
        self._watcher = self.submit(self._watch())

    async def _open(
        self, target: str, client_name: str, timeout: float, security: ChannelSecurity
    ) -> AsyncClient:
        kv = AsyncClient(target, client_name=client_name, timeout=timeout, security=security)
        await kv.session_id()
        return kv

    def call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the client's loop and wait for its result (start-up, shutdown)."""
        return self.submit(coro).result(timeout)

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def transfer(
        self,
        transfer_id: str,
        start: Callable[[AsyncClient], Awaitable[TransferStatus]],
        deadline_ms: int,
    ) -> concurrent.futures.Future[TransferStatus]:
        """Run ``start(kv)`` (ExpectDelta or SendDelta of ``transfer_id``); the future ends with the
        transfer's terminal status, or the client error that kept it from starting."""
        return self.submit(self._transfer(transfer_id, start, deadline_ms))

    async def _transfer(
        self, tid: str, start: Callable[[AsyncClient], Awaitable[TransferStatus]], deadline_ms: int
    ) -> TransferStatus:
        loop = asyncio.get_running_loop()
        waiter = self._waiters.get(tid)
        if waiter is None or waiter.done():
            waiter = self._waiters[tid] = loop.create_future()  # before the call: no event is lost
        try:
            st = await start(self.kv)
            end = loop.time() + deadline_ms / 1000 + _SAFETY_S
            while not st.terminal:
                if loop.time() > end:
                    raise asyncio.TimeoutError(f"transfer {tid} not settled past its deadline")
                try:
                    return await asyncio.wait_for(asyncio.shield(waiter), 1.0)
                except asyncio.TimeoutError:
                    found = await self.kv.poll([tid])
                    st = found[0] if found else st
            return st
        finally:
            if self._waiters.get(tid) is waiter:
                del self._waiters[tid]

    async def _watch(self) -> None:
        while True:
            try:
                async for st in self.kv.watch(include_current=False):
                    w = self._waiters.get(st.transfer_id)
                    if st.terminal and w is not None and not w.done():
                        w.set_result(st)
            except asyncio.CancelledError:
                return
            except KVClientError as exc:  # the session is lost: every transfer waiting fails now
                for w in list(self._waiters.values()):
                    if not w.done():
                        w.set_exception(exc)
                        w.exception()  # retrieved by whoever awaits it; never "never retrieved"
                await asyncio.sleep(0.5)

    def close(self) -> None:
        self._watcher.cancel()
        with contextlib.suppress(Exception):
            self.call(self.kv.close(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def __enter__(self) -> BackgroundClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
