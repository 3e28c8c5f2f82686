"""The receiver's half of a commit (Inbound) on declarations made in-process: no service, no wire."""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any

import numpy as np
import pytest
import torch

from kvservice import kernels
from kvservice.errors import FailedPrecondition, InvalidArgument, KVServiceError, NotFound
from kvservice.staging import StagingPool
from kvservice.transfer.inbound import Inbound
from kvservice.transfer.plan import Units
from kvservice.transfer.receiver import Incoming, Receiver
from kvservice.transfer.records import Record, TransferTable
from kvservice.transfer.values import Commit
from tests.support.regions import LAYOUT, pages_of, random_regions

SENDER = "prefill/0"
HEADS = LAYOUT.local_kv_heads


class Side:
    """One declaration of transfer ``t`` (delta pages ``dst``) and the Inbound that applies commits."""

    def __init__(self, dst: list[int], prefix: int = 0, publish: bool = False) -> None:
        self.table = TransferTable(60.0)
        self.pool = StagingPool(1 << 20, "host")
        self.receiver = Receiver(self.table, lambda _bs: self.pool)
        self.regions = random_regions(LAYOUT, 7)
        self.failed: list[KVServiceError] = []
        self.published: list[Any] = []
        bs = types.SimpleNamespace(buffer_set_id="d-bs", layout=LAYOUT, lost=lambda: "")  # memory whole
        rec = Record("t", "RECEIVER", "d-bs", "s", time.monotonic() + 30)
        hashes = np.arange(prefix + len(dst), dtype=np.uint64) if publish else None
        self.inc = Incoming(
            rec, bs, prefix, np.asarray(dst, dtype=np.int64), {}, 1, hashes, np.arange(prefix, dtype=np.int64)
        )  # type: ignore[arg-type]
        self.inc.units[SENDER] = Units(LAYOUT.page_size, 1, 1)
        self.inc.covered[SENDER] = np.zeros(len(dst), dtype=bool)
        self.inc.identities["prefill"], self.inc.tickets[SENDER] = "peer-a", "ticket-a"  # as plans() binds
        asyncio.run(self.receiver.expect(self.inc))
        index = types.SimpleNamespace(publish=lambda *a, **k: self.published.append(a))
        self.inbound = Inbound(self.table, self.receiver, lambda _i: self.regions, set(), self._fail, index)

    async def _fail(self, inc: Incoming, exc: KVServiceError) -> None:
        self.failed.append(exc)
        self.table.finish(inc.rec, "FAILED", exc.code.name, exc.message)

    def accept(self, c: Commit) -> str:
        return asyncio.run(self.inbound.accept(self.inc, SENDER, c))


def _commit(positions: list[int], **kw: Any) -> Commit:
    return Commit(np.asarray(positions, dtype=np.int64), kw.pop("path", "FUSED"), 0, HEADS, **kw)


def test_the_last_commit_covering_the_delta_is_done_and_publishes() -> None:
    """Two commits cover every delta page; the last makes DONE and inserts the pages."""
    side = Side([4, 9, 6], prefix=1, publish=True)
    side.accept(_commit([1, 2]))
    assert side.inc.rec.state != "DONE" and not side.published
    assert side.accept(_commit([3], last=True, skipped=1)) == "DONE"
    assert len(side.published) == 1 and not side.failed


def test_a_last_commit_with_pages_unsent_fails_the_transfer() -> None:
    """DONE means the bytes arrived: a sender ending with delta pages uncovered fails it."""
    side = Side([4, 9, 6])
    with pytest.raises(FailedPrecondition, match="1 of 3 delta pages unsent"):
        side.accept(_commit([0, 1], last=True))
    assert side.inc.rec.state == "FAILED" and not side.published


def test_positions_outside_the_declared_delta_fail_the_transfer() -> None:
    """A commit naming a position past the delta is refused and ends the transfer."""
    side = Side([4, 9])
    with pytest.raises(InvalidArgument, match="outside the declared delta"):
        side.accept(_commit([5]))
    assert side.inc.rec.state == "FAILED"


def test_a_packed_commit_into_a_slot_it_never_reserved_is_not_found() -> None:
    """No reserved slot: NOT_FOUND, nothing unpacked, nothing counted."""
    side = Side([4, 9])
    before = pages_of(side.regions, LAYOUT, np.arange(32))
    with pytest.raises(NotFound, match="staging_slot"):
        side.accept(_commit([0], path="PACKED", slot_id=99, nbytes=1))
    assert all(
        torch.equal(a, b) for a, b in zip(pages_of(side.regions, LAYOUT, np.arange(32)), before, strict=True)
    )
    assert side.inc.rec.bytes_sent == 0


def test_a_packed_commit_unpacks_its_slot_into_the_named_pages_and_frees_it() -> None:
    """The batch in the reserved slot lands in the delta pages its positions name; the slot is free."""
    side = Side([4, 9, 6])
    src = random_regions(LAYOUT, 3)
    staged = kernels.pack(src, np.array([1, 2, 3]), num_heads=HEADS)
    pool, slot = asyncio.run(side.receiver.reserve("t", "d-bs", staged.numel(), "peer-a", "ticket-a"))
    pool.view(slot)[: staged.numel()].copy_(staged)
    assert side.accept(_commit([0, 1, 2], path="PACKED", slot_id=slot.serial, last=True)) == "DONE"
    got, want = (
        pages_of(side.regions, LAYOUT, np.array([4, 9, 6])),
        pages_of(src, LAYOUT, np.array([1, 2, 3])),
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert side.pool.stats().slots_in_use == 0


def test_a_packed_slot_too_small_for_its_positions_fails_and_is_freed() -> None:
    """A commit claiming more pages than its slot holds: FAILED, nothing unpacked, slot freed."""
    side = Side([4, 9, 6])
    _, slot = asyncio.run(side.receiver.reserve("t", "d-bs", 256, "peer-a", "ticket-a"))
    with pytest.raises(FailedPrecondition, match="staging slot"):
        side.accept(_commit([0, 1, 2], path="PACKED", slot_id=slot.serial))
    assert side.inc.rec.state == "FAILED" and side.pool.stats().slots_in_use == 0


def test_quiet_returns_only_once_every_writer_left() -> None:
    """An abort's wait for copies in flight ends at the last leave, not at a poll."""
    inc = Side([4]).inc

    async def run() -> None:
        inc.enter()
        inc.enter()
        waiter = asyncio.ensure_future(inc.quiet())
        await asyncio.sleep(0)
        assert not waiter.done()
        inc.leave()
        await asyncio.sleep(0)
        assert not waiter.done()
        inc.leave()
        await asyncio.wait_for(waiter, 1)
        await asyncio.wait_for(inc.quiet(), 1)  # nothing in flight: at once

    asyncio.run(run())


def test_a_plan_asked_before_its_declaration_waits_for_that_transfer_only() -> None:
    """GetReceivePlan before ExpectDelta waits; another transfer's declaration does not end the
    wait (per-id waiters), its own does; an undeclared one is NotFound after the wait."""

    def incoming(tid: str) -> Incoming:
        bs = types.SimpleNamespace(buffer_set_id=f"bs-{tid}", layout=LAYOUT, lost=lambda: "")
        rec = Record(tid, "RECEIVER", bs.buffer_set_id, "s", time.monotonic() + 30)
        empty = np.zeros(0, dtype=np.int64)
        return Incoming(rec, bs, 0, np.array([1], dtype=np.int64), {}, 0, None, empty)  # type: ignore[arg-type]

    async def run() -> None:
        receiver = Receiver(TransferTable(60.0), lambda _bs: None)  # type: ignore[arg-type,return-value]
        asked = asyncio.ensure_future(receiver.plans("late", LAYOUT, "prefill", "addr", 5.0, ""))
        await asyncio.sleep(0.05)
        await receiver.expect(incoming("other"))
        await asyncio.sleep(0.05)
        assert not asked.done() and len(receiver._waiters["late"]) == 1
        await receiver.expect(incoming("late"))
        (found,) = await asyncio.wait_for(asked, 2.0)
        assert found[0].rec.transfer_id == "late" and not receiver._waiters
        with pytest.raises(NotFound, match="never declared 'nobody'"):
            await receiver.plans("nobody", LAYOUT, "prefill", "addr", 0.05, "")
        assert not receiver._waiters

    asyncio.run(run())
