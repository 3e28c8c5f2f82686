"""Completion of GPU work without a spinning event loop: a thread blocks on CUDA events.

    loop thread: launch on a service stream ─▶ record event ─▶ await completions.done(event, key)
    completion thread (one per key, e.g. a device and a stream role):
        event.synchronize()  (the GIL released while it waits)
        ─▶ loop.call_soon_threadsafe(future.set_result)

Work that has no event to block on (a NIXL request's state) is polled by a thread of its own
(``polled``): it checks its pending requests, sleeps ~20 µs with the GIL released while any is
pending, and blocks on its queue when none is.

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
import time
from collections.abc import Callable
from typing import Any

__all__ = ["done", "polled", "shutdown"]

POLL_S = 20e-6  # a poller's sleep between rounds while requests are pending (GIL released)

_threads: dict[Any, _Waiter | _Poller] = {}
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
                _post(loop, fut, exc)
            else:
                _post(loop, fut, None)


class _Poller:
    """Polls ``check()`` of each pending job until it is true (or raises), in its own thread."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.jobs: queue.SimpleQueue[
            tuple[Callable[[], bool], asyncio.AbstractEventLoop, asyncio.Future[None]] | None
        ] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"poll-completions-{key}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pending: list[tuple[Callable[[], bool], asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        while True:
            if not pending:  # idle: block (GIL released) until a job or the shutdown comes
                job = self.jobs.get()
                if job is None:
                    return
                pending.append(job)
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    return
                pending.append(job)
            still = []
            for check, loop, fut in pending:
                try:
                    ok = check()
                except BaseException as exc:  # e.g. the request was released meanwhile
                    _post(loop, fut, exc)
                    continue
                if ok:
                    _post(loop, fut, None)
                else:
                    still.append((check, loop, fut))
            pending = still
            if pending:
                time.sleep(POLL_S)


def _post(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], exc: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(_settle, fut, exc)
    except RuntimeError:  # the loop closed meanwhile: nobody awaits the future any more
        pass


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
    _thread_for(key, _Waiter).jobs.put((event, loop, fut))
    return fut


def polled(check: Callable[[], bool], key: Any) -> asyncio.Future[None]:
    """A future of the running loop that completes once ``check()`` (thread-safe, cheap, never
    blocking) returns true, or fails with what it raised; a poller thread per ``key`` calls it.
    A cancelled future is fine: its job ends once ``check`` is true or raises."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    if check():  # already complete: no thread hop
        fut.set_result(None)
        return fut
    _thread_for(key, _Poller).jobs.put((check, loop, fut))  # type: ignore[arg-type]
    return fut


def _thread_for(key: Any, kind: type) -> Any:
    worker = _threads.get(key)
    if worker is None:
        with _lock:
            worker = _threads.get(key)
            if worker is None:
                worker = _threads[key] = kind(key)
    return worker


def shutdown(timeout: float = 5.0) -> None:
    """Stop the completion threads once the events handed to them completed, and the pollers
    (service close)."""
    with _lock:
        waiters = list(_threads.values())
        _threads.clear()
    for w in waiters:
        w.jobs.put(None)
    for w in waiters:
        w.thread.join(timeout)
