"""ByteBudget (transfer/budget.py): per-peer concurrency in bytes, granted in arrival order."""

from __future__ import annotations

import asyncio

import pytest

from kvservice.transfer.budget import ByteBudget


async def _holder(b: ByteBudget, n: int, log: list[str], name: str, release: asyncio.Event) -> None:
    async with b.hold(n):
        log.append(name)
        await release.wait()


def test_small_chunks_run_side_by_side_and_a_large_one_waits_its_turn() -> None:
    async def main() -> None:
        b, log = ByteBudget(100, 64), []
        go = asyncio.Event()
        small = [asyncio.create_task(_holder(b, 10, log, f"s{i}", go)) for i in range(5)]
        await asyncio.sleep(0)
        assert sorted(log) == [f"s{i}" for i in range(5)] and b.used == 50
        big = asyncio.create_task(_holder(b, 80, log, "big", go))  # 50 + 80 > 100: waits
        late = asyncio.create_task(_holder(b, 10, log, "late", go))  # fits, but must not overtake
        await asyncio.sleep(0)
        assert "big" not in log and "late" not in log
        go.set()
        await asyncio.gather(*small, big, late)
        assert log.index("big") < log.index("late") and b.used == 0 and b.holders == 0

    asyncio.run(main())


def test_a_chunk_larger_than_the_budget_moves_alone() -> None:
    async def main() -> None:
        b, log = ByteBudget(100, 64), []
        go = asyncio.Event()
        t = asyncio.create_task(_holder(b, 1000, log, "huge", go))
        await asyncio.sleep(0)
        assert log == ["huge"]
        other = asyncio.create_task(_holder(b, 1, log, "tiny", go))
        await asyncio.sleep(0)
        assert log == ["huge"]
        go.set()
        await asyncio.gather(t, other)
        assert b.used == 0

    asyncio.run(main())


def test_the_chunk_count_caps_too_and_a_cancelled_waiter_frees_its_place() -> None:
    async def main() -> None:
        b, log = ByteBudget(1 << 30, 2), []
        go = asyncio.Event()
        first = [asyncio.create_task(_holder(b, 1, log, f"h{i}", go)) for i in range(2)]
        waiting = asyncio.create_task(_holder(b, 1, log, "cancelled", go))
        behind = asyncio.create_task(_holder(b, 1, log, "behind", go))
        await asyncio.sleep(0)
        assert len(log) == 2
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        go.set()
        await asyncio.gather(*first, behind)
        assert "cancelled" not in log and "behind" in log and b.holders == 0 and b.used == 0

    asyncio.run(main())
