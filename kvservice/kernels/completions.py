"""Completion of GPU work without a spinning event loop: a thread blocks on CUDA events.

    loop thread: launch on a service stream ─▶ record event ─▶ await completions.done(event, key)
    completion thread (one per key, e.g. a device and a stream role):
        event.synchronize()  (the GIL released while it waits)
        ─▶ loop.call_soon_threadsafe(future.set_result)

Under uvloop ``asyncio.sleep(d)`` below ~0.5 ms returns at once, so a query-and-sleep loop is a
busy spin of the loop thread that holds the GIL and starves every other thread of the service
(DESIGN.md, data path v3 §1). Here the loop sleeps in epoll until the one wake-up per
completion. Events of one key are waited for in the order they were handed over (one stream's
events complete in that order too).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

__all__ = ["done", "shutdown"]

_threads: dict[Any, _Waiter] = {}
_lock = threading.Lock()


class _Waiter:
    def __init__(self, key: Any) -> None:
        self.key = key
        self.jobs: queue.SimpleQueue[tuple[Any, asyncio.AbstractEventLoop, asyncio.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._run, name=f"cuda-completions-{key}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            event, loop, fut = job
            try:
                event.synchronize()
            except BaseException as exc:  # a device error reaches the awaiting transfer
                loop.call_soon_threadsafe(_settle, fut, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, None)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():  # the awaiting task was cancelled meanwhile
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def done(event: Any, key: Any) -> asyncio.Future[None]:
    """A future of the running loop that completes once ``event`` (a recorded CUDA event) has;
    the loop never polls for it. ``key`` picks the waiting thread (a device, or a device and a
    stream role): events of one key are waited for in order, so give each stream its own."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    if event.query():  # already complete: no thread hop
        fut.set_result(None)
        return fut
    waiter = _threads.get(key)
    if waiter is None:
        with _lock:
            waiter = _threads.get(key)
            if waiter is None:
                waiter = _threads[key] = _Waiter(key)
    waiter.jobs.put((event, loop, fut))
    return fut


def shutdown(timeout: float = 5.0) -> None:
    """Stop the completion threads once the events handed to them completed (service close)."""
    with _lock:
        waiters = list(_threads.values())
        _threads.clear()
    for w in waiters:
        w.jobs.put(None)
    for w in waiters:
        w.thread.join(timeout)
