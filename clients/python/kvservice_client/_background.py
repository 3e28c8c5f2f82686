"""An :class:`AsyncClient` on an event-loop thread of its own, for engine threads that must not block.

Engine adapters (vLLM connector, SGLang backend) start transfers from a scheduler or model-runner
thread and look at their outcome later; every RPC runs here, off that thread::

    fut = bg.transfer("room-7", lambda kv: kv.send_delta(...), deadline_ms=30_000)
    ...                                  # the engine thread goes on
    if fut.done(): status = fut.result()  # the terminal TransferStatus (or the client error)

A transfer's end comes from one WatchTransfers stream of the session, with a poll each second as a
backstop (an event sent before the stream was open is not replayed).

A transfer sent in chunks as the engine computes them (layer-wise streaming) is a
:class:`ChunkedSend`: ``bg.chunked(transfer_id, deadline_ms)``, then ``send(start, last)`` per chunk
from any thread; the chunks go in the order given, one at a time (a chunk's call returns before
the next starts, as the service's in-order rule needs), and ``done`` ends like ``transfer``'s future.
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

__all__ = ["BackgroundClient", "ChunkedSend"]

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

    def chunked(self, transfer_id: str, deadline_ms: int) -> ChunkedSend:
        """A transfer whose chunks the caller hands over one by one (see :class:`ChunkedSend`)."""
        return ChunkedSend(self, transfer_id, deadline_ms)

    def _waiter(self, tid: str) -> asyncio.Future[TransferStatus]:
        waiter = self._waiters.get(tid)
        if waiter is None or waiter.done():
            waiter = self._waiters[tid] = asyncio.get_running_loop().create_future()
        return waiter

    async def _transfer(
        self, tid: str, start: Callable[[AsyncClient], Awaitable[TransferStatus]], deadline_ms: int
    ) -> TransferStatus:
        waiter = self._waiter(tid)  # before the call: no event is lost
        try:
            return await self._settle(tid, waiter, await start(self.kv), deadline_ms)
        finally:
            if self._waiters.get(tid) is waiter:
                del self._waiters[tid]

    async def _settle(
        self, tid: str, waiter: asyncio.Future[TransferStatus], st: TransferStatus, deadline_ms: int
    ) -> TransferStatus:
        """``st`` (a call's answer) until the transfer is terminal: its event, else a poll a second."""
        loop = asyncio.get_running_loop()
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


class ChunkedSend:
    """One transfer sent as chunks, in the order :meth:`send` is called (from any thread).

    Each chunk is a call ``start(kv)`` (a SendDelta naming its ``chunk_offset`` and ``last_chunk``);
    the next starts once it returned, so the service sees them in order. ``done`` ends with the
    transfer's terminal status after the chunk sent with ``last=True`` (or after a chunk whose
    answer is already terminal: a refused stream sends nothing more), or with the error of the
    call that failed (the chunks after it are not sent). :meth:`cancel` drops the chunks not yet
    sent and ends ``done`` with :class:`asyncio.CancelledError` (the caller aborts the transfer).
    """

    def __init__(self, bg: BackgroundClient, transfer_id: str, deadline_ms: int) -> None:
        self.transfer_id = transfer_id
        self._bg = bg
        # NOTE: made on the caller's thread, bound to the client's loop at its first use there
        self._queue: asyncio.Queue[tuple[Callable[[AsyncClient], Awaitable[TransferStatus]], bool]] = (
            asyncio.Queue()
        )
        self.done: concurrent.futures.Future[TransferStatus] = bg.submit(self._run(deadline_ms))

    def send(self, start: Callable[[AsyncClient], Awaitable[TransferStatus]], last: bool) -> None:
        self._bg.loop.call_soon_threadsafe(self._queue.put_nowait, (start, last))

    def cancel(self) -> None:
        self.done.cancel()

    async def _run(self, deadline_ms: int) -> TransferStatus:
        bg, tid = self._bg, self.transfer_id
        waiter = bg._waiter(tid)  # before the first call: no event is lost
        try:
            while True:
                start, last = await self._queue.get()
                st = await start(bg.kv)
                if last or st.terminal:
                    return await bg._settle(tid, waiter, st, deadline_ms)
        finally:
            if bg._waiters.get(tid) is waiter:
                del bg._waiters[tid]
