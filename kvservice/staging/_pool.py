"""Service-owned staging memory: one allocation, registered with the transport once, sliced into slots.

Contract:

- ``await pool.reserve(nbytes, deadline)`` returns a :class:`Slot` as soon as one fits, in
  FIFO order: while anyone waits, later requests queue behind them, so a big request is not
  starved by a stream of small ones. Past ``deadline`` (absolute ``time.monotonic()``) it
  raises :class:`ResourceExhausted`; a request larger than the pool raises at once.
  Cancelling the waiting task cancels the request and leaks nothing.
- ``pool.release(slot)`` is idempotent: it returns True the first time and False for a slot
  already released (or released by ``close``); a stale slot never frees a range since handed
  to someone else (slots carry a serial). A slot of another pool raises InvalidArgument.
- ``async with pool.slot(nbytes, deadline) as s:`` releases on every exit path.
- Calls belong to the event loop thread (the allocator is not locked); other threads use
  ``loop.call_soon_threadsafe(pool.release, slot)``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal

import torch

from ..errors import InvalidArgument, ResourceExhausted, Unavailable, Unimplemented
from ._allocator import RangeAllocator

__all__ = ["MemKind", "RegisterFn", "Slot", "StagingPool", "StagingStats"]

MemKind = Literal["vram", "pinned", "host"]
# register(addr, size, mem_kind, device): mem_kind is NIXL's "VRAM" or "DRAM"; device is the
# CUDA index (0 for host memory). deregister takes the same arguments.
RegisterFn = Callable[[int, int, str, int], object]

_serials = itertools.count(1)
_pool_ids = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class StagingStats:
    """A snapshot for GetStats."""

    kind: MemKind
    capacity_bytes: int
    used_bytes: int
    slots_in_use: int
    waiters: int


@dataclasses.dataclass(frozen=True)
class Slot:
    """Bytes ``[offset, offset + nbytes)`` of a pool; ``addr`` is the absolute address."""

    offset: int
    nbytes: int
    addr: int
    serial: int
    pool_id: int


@dataclasses.dataclass(eq=False)
class _Waiter:
    nbytes: int
    future: asyncio.Future[Slot]


class StagingPool:
    """A pool of ``capacity_bytes`` of ``kind`` memory with an aligned first-fit slot allocator."""

    def __init__(
        self,
        capacity_bytes: int,
        kind: Literal["vram", "host"] = "host",
        *,
        device: int = 0,
        alignment: int = 256,
        register: RegisterFn | None = None,
        deregister: RegisterFn | None = None,
    ) -> None:
        """Allocate and register. ``kind="host"`` is pinned when CUDA exists, plain otherwise.

        Raises InvalidArgument (bad size/alignment) or Unimplemented (VRAM without CUDA).
        """
        if capacity_bytes < alignment or alignment < 1 or alignment & (alignment - 1):
            raise InvalidArgument(
                "staging.capacity_bytes", f"{capacity_bytes} bytes with alignment {alignment}"
            )
        if kind == "vram":
            if not torch.cuda.is_available():
                raise Unimplemented("staging.kind: VRAM staging needs CUDA")
            buf = torch.empty(capacity_bytes, dtype=torch.uint8, device=f"cuda:{device}")
            self.kind: MemKind = "vram"
        elif kind == "host":
            buf = torch.empty(capacity_bytes, dtype=torch.uint8)
            self.kind = "host"
            if torch.cuda.is_available():
                buf, self.kind = buf.pin_memory(), "pinned"
        else:
            raise InvalidArgument("staging.kind", f"must be 'vram' or 'host', got {kind!r}")
        self.buffer = buf
        self.device = device if kind == "vram" else 0
        self._alloc = RangeAllocator(capacity_bytes, alignment)
        self._slots: dict[int, Slot] = {}  # offset -> live slot
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._closed = False
        self._id = next(_pool_ids)
        self._deregister = deregister
        self._reg_args = (
            buf.data_ptr(),
            self._alloc.capacity,
            "VRAM" if self.kind == "vram" else "DRAM",
            self.device,
        )
        if register is not None:
            register(*self._reg_args)

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity

    def view(self, slot: Slot) -> torch.Tensor:
        """The slot's bytes as a 1-D uint8 tensor (valid until released)."""
        self._check_owner(slot)
        return self.buffer[slot.offset : slot.offset + slot.nbytes]

    def try_reserve(self, nbytes: int) -> Slot | None:
        """A slot now, or None if it does not fit or others are already waiting (FIFO)."""
        self._check_request(nbytes)
        return None if self._waiters else self._grant(nbytes)

    async def reserve(self, nbytes: int, deadline: float | None = None) -> Slot:
        """Wait (FIFO) until ``nbytes`` fit; ResourceExhausted past ``deadline``."""
        slot = self.try_reserve(nbytes)
        if slot is not None:
            return slot
        loop = asyncio.get_running_loop()
        waiter = _Waiter(nbytes, loop.create_future())
        self._waiters.append(waiter)
        timer = None
        if deadline is not None:
            timer = loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, waiter)
        try:
            return await waiter.future
        except BaseException:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())  # granted while we were being cancelled
            raise
        finally:
            if timer is not None:
                timer.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            self._wake()

    @contextlib.asynccontextmanager
    async def slot(self, nbytes: int, deadline: float | None = None) -> AsyncIterator[Slot]:
        """``async with pool.slot(n, deadline) as s``: reserve, and release on any exit."""
        s = await self.reserve(nbytes, deadline)
        try:
            yield s
        finally:
            self.release(s)

    def release(self, slot: Slot) -> bool:
        """Free ``slot``; True if it was live, False if already released (idempotent)."""
        self._check_owner(slot)
        live = self._slots.get(slot.offset)
        if live is None or live.serial != slot.serial:
            return False
        del self._slots[slot.offset]
        self._alloc.free(slot.offset)
        self._wake()
        return True

    def stats(self) -> StagingStats:
        return StagingStats(
            self.kind, self.capacity_bytes, self._alloc.used_bytes, len(self._slots), len(self._waiters)
        )

    def check_integrity(self) -> None:
        """Allocator invariants, and every live slot is exactly one used range."""
        self._alloc.check_integrity()
        assert len(self._slots) == self._alloc.num_used
        assert all(self._alloc.size_of(s.offset) >= s.nbytes for s in self._slots.values())

    def close(self) -> None:
        """Fail every waiter (Unavailable), drop all slots, deregister. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._waiters:
            if not w.future.done():
                w.future.set_exception(Unavailable("staging pool closed"))
        for off in list(self._slots):
            del self._slots[off]
            self._alloc.free(off)
        if self._deregister is not None:
            self._deregister(*self._reg_args)

    # -- internals -------------------------------------------------------------------------

    def _check_owner(self, slot: Slot) -> None:
        if slot.pool_id != self._id:
            raise InvalidArgument("slot", "belongs to another staging pool")

    def _check_request(self, nbytes: int) -> None:
        if self._closed:
            raise Unavailable("staging pool closed")
        if nbytes < 1:
            raise InvalidArgument("nbytes", f"must be >= 1, got {nbytes}")
        if self._alloc.round(nbytes) > self.capacity_bytes:
            raise ResourceExhausted(
                f"staging: {nbytes} bytes exceed the {self.kind} pool of {self.capacity_bytes}"
            )

    def _grant(self, nbytes: int) -> Slot | None:
        got = self._alloc.alloc(nbytes)
        if got is None:
            return None
        off = got[0]
        slot = Slot(off, nbytes, self.buffer.data_ptr() + off, next(_serials), self._id)
        self._slots[off] = slot
        return slot

    def _wake(self) -> None:
        """Grant waiters in order; stop at the first that does not fit (FIFO)."""
        while self._waiters and not self._closed:
            head = self._waiters[0]
            if head.future.done():
                self._waiters.popleft()
                continue
            slot = self._grant(head.nbytes)
            if slot is None:
                return
            self._waiters.popleft()
            head.future.set_result(slot)

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            waiter.future.set_exception(
                ResourceExhausted(
                    f"staging: no {waiter.nbytes} bytes free in the {self.kind} pool before the deadline"
                )
            )
