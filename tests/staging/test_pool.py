"""StagingPool: back-pressure, FIFO fairness, deadlines, cancellation, idempotent release."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvservice.staging import Slot, StagingPool, StagingStats

KIB = 1024


def _pool(capacity: int = 4 * KIB, **kw: object) -> StagingPool:
    return StagingPool(capacity, "host", alignment=256, **kw)  # type: ignore[arg-type]


def _soon(seconds: float = 0.05) -> float:
    return time.monotonic() + seconds


async def test_reserve_gives_disjoint_aligned_slots() -> None:
    """Slots are aligned, disjoint views of the pool's buffer."""
    pool = _pool()
    a, b = await pool.reserve(100), await pool.reserve(300)
    assert (a.offset, b.offset) == (0, 256) and b.addr == pool.buffer.data_ptr() + 256
    assert pool.view(b).numel() == 300
    assert pool.stats() == StagingStats(pool.kind, 4 * KIB, 768, 2, 0)
    pool.check_integrity()


async def test_reserve_waits_for_a_release() -> None:
    """A full pool makes reserve wait until a release frees enough bytes."""
    pool = _pool()
    full = await pool.reserve(4 * KIB)
    task = asyncio.create_task(pool.reserve(KIB, _soon(1.0)))
    await asyncio.sleep(0)
    assert not task.done() and pool.stats().waiters == 1
    pool.release(full)
    slot = await task
    assert slot.offset == 0 and pool.stats().waiters == 0
    pool.check_integrity()


async def test_deadline_raises_resource_exhausted() -> None:
    """Past its deadline a waiting reserve raises ResourceExhausted and leaves no waiter."""
    pool = _pool()
    await pool.reserve(4 * KIB)
    with pytest.raises(ResourceExhausted):
        await pool.reserve(KIB, _soon(0.02))
    assert pool.stats().waiters == 0
    pool.check_integrity()


async def test_larger_than_pool_fails_at_once() -> None:
    """A request that can never fit raises ResourceExhausted without waiting."""
    with pytest.raises(ResourceExhausted):
        await _pool().reserve(4 * KIB + 1, deadline=None)


async def test_fifo_big_request_is_not_starved() -> None:
    """While a big request waits, later small ones queue behind it even if they would fit."""
    pool = _pool()
    smalls = [await pool.reserve(KIB) for _ in range(4)]
    big = asyncio.create_task(pool.reserve(3 * KIB, _soon(1.0)))
    await asyncio.sleep(0)
    pool.release(smalls[0])
    late_small = asyncio.create_task(pool.reserve(KIB, _soon(1.0)))
    await asyncio.sleep(0)
    assert pool.try_reserve(KIB) is None  # a free KiB exists, but FIFO says wait
    assert not late_small.done() and not big.done()
    pool.release(smalls[1])
    pool.release(smalls[2])
    assert (await big).nbytes == 3 * KIB
    assert not late_small.done()
    pool.release(smalls[3])
    await late_small
    pool.check_integrity()


async def test_cancelled_waiter_leaks_nothing_and_unblocks_followers() -> None:
    """Cancelling the head waiter removes it; the next waiter gets served."""
    pool = _pool()
    held = await pool.reserve(3 * KIB)
    head = asyncio.create_task(pool.reserve(2 * KIB))
    follower = asyncio.create_task(pool.reserve(KIB, _soon(1.0)))
    await asyncio.sleep(0)
    head.cancel()
    with pytest.raises(asyncio.CancelledError):
        await head
    assert (await follower).nbytes == KIB
    pool.release(held)
    assert pool.stats().slots_in_use == 1 and pool.stats().waiters == 0
    pool.check_integrity()


async def test_cancel_after_grant_releases_the_slot() -> None:
    """A waiter cancelled in the same tick it was granted gives its slot back."""
    pool = _pool()
    held = await pool.reserve(4 * KIB)
    task = asyncio.create_task(pool.reserve(KIB))
    await asyncio.sleep(0)
    pool.release(held)  # grants the waiter's future ...
    task.cancel()  # ... but the task is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.stats().used_bytes == 0
    pool.check_integrity()


@pytest.mark.parametrize("failure", [RuntimeError("boom"), asyncio.CancelledError()])
async def test_slot_context_releases_on_failure(failure: BaseException) -> None:
    """An exception or cancellation inside ``async with pool.slot()`` releases the slot."""
    pool = _pool()
    with pytest.raises(type(failure)):
        async with pool.slot(KIB) as s:
            assert pool.stats().slots_in_use == 1 and s.nbytes == KIB
            raise failure
    assert pool.stats().used_bytes == 0
    pool.check_integrity()


async def test_task_cancelled_inside_slot_context_releases() -> None:
    """Cancelling a task blocked inside the context releases its slot."""
    pool = _pool()
    entered = asyncio.Event()

    async def work() -> None:
        async with pool.slot(KIB):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(work())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.stats().slots_in_use == 0


async def test_release_is_idempotent_and_stale_slots_are_harmless() -> None:
    """A second release returns False and never frees a range handed to someone else."""
    pool = _pool()
    a = await pool.reserve(KIB)
    assert pool.release(a) is True
    b = await pool.reserve(KIB)
    assert b.offset == a.offset
    assert pool.release(a) is False
    assert pool.stats().slots_in_use == 1
    pool.check_integrity()


async def test_foreign_slot_is_rejected() -> None:
    """Releasing a slot of another pool raises InvalidArgument."""
    other = await _pool().reserve(KIB)
    with pytest.raises(InvalidArgument):
        _pool().release(other)


async def test_registered_once_and_closed_fails_waiters() -> None:
    """register runs once at creation, deregister once at close; close fails waiters."""
    calls: list[tuple[str, int, int, str, int]] = []
    pool = _pool(
        register=lambda *a: calls.append(("reg", *a)), deregister=lambda *a: calls.append(("dereg", *a))
    )
    await pool.reserve(4 * KIB)
    for _ in range(3):
        s = pool.try_reserve(1)
        assert s is None
    waiter = asyncio.create_task(pool.reserve(KIB))
    await asyncio.sleep(0)
    pool.close()
    pool.close()
    with pytest.raises(Unavailable):
        await waiter
    assert calls == [
        ("reg", pool.buffer.data_ptr(), 4 * KIB, "DRAM", 0),
        ("dereg", pool.buffer.data_ptr(), 4 * KIB, "DRAM", 0),
    ]
    with pytest.raises(Unavailable):
        await pool.reserve(1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 2 * KIB), st.integers(0, 30)), max_size=60))
def test_fuzz_reserve_release(ops: list[tuple[bool, int, int]]) -> None:
    """Random reserve/release (double releases included) keep the pool's invariants."""
    pool = _pool(8 * KIB)
    live: list[Slot] = []
    released: list[Slot] = []
    for is_reserve, nbytes, pick in ops:
        if is_reserve:
            s = pool.try_reserve(nbytes)
            if s is not None:
                live.append(s)
        elif live:
            s = live.pop(pick % len(live))
            assert pool.release(s)
            released.append(s)
        elif released:
            assert not pool.release(released[pick % len(released)])
        pool.check_integrity()
        assert pool.stats().slots_in_use == len(live)
