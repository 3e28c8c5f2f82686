"""Per-peer concurrency as bytes in flight (data path v3 §2), not a count of transfers.

A chunk moving to a peer holds its bytes from the budget until it ended. Holds are granted in
arrival order (a large chunk is not starved by small ones behind it); a chunk larger than the
whole budget moves alone (it is never refused). ``max_chunks`` still bounds how many chunks run
at once (the loop's own work per chunk).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

__all__ = ["ByteBudget"]


class ByteBudget:
    def __init__(self, limit_bytes: int, max_chunks: int) -> None:
        if limit_bytes < 1 or max_chunks < 1:
            raise ValueError("ByteBudget: limit_bytes and max_chunks must be >= 1")
        self.limit, self.max_chunks = limit_bytes, max_chunks
        self.used = 0  # bytes held
        self.holders = 0  # chunks holding
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, n: int) -> bool:
        if self.holders >= self.max_chunks:
            return False
        return self.holders == 0 or self.used + n <= self.limit

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` of the budget for the body (waiting for room, in arrival order)."""
        if not self._waiters and self._fits(nbytes):
            self._take(nbytes)
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (nbytes, fut)
            self._waiters.append(entry)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():  # granted, then cancelled: give it back
                    self._give(nbytes)
                else:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(entry)
                    self._wake()  # it may have been the head blocking smaller waiters
                raise
        try:
            yield
        finally:
            self._give(nbytes)

    def _take(self, n: int) -> None:
        self.used += n
        self.holders += 1

    def _give(self, n: int) -> None:
        self.used -= n
        self.holders -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(n):
                return
            self._waiters.popleft()
            self._take(n)
            fut.set_result(None)
