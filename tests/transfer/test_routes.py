"""The routes and the path choice against a fake receiver port (no service, no transport)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import types
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch

from kvservice import kernels
from kvservice.errors import Aborted, FailedPrecondition, TransportError
from kvservice.kernels import KVRegions
from kvservice.kernels.heads import HeadRoute
from kvservice.staging import StagingPool
from kvservice.transfer.dispatch import path_of
from kvservice.transfer.plan import map_chunk
from kvservice.transfer.records import Record, TransferTable
from kvservice.transfer.routes import RouteContext
from kvservice.transfer.routes.packed import PackedRoute
from kvservice.transfer.routes.same_node import SameNodeRoute
from kvservice.transfer.sender import Chunk, Outgoing
from kvservice.transfer.values import Commit, Plan, Reserved, Target
from tests.support.regions import LAYOUT, pages_of, random_regions, small_layout


class FakePort:
    """A receiver whose pools live in this process: records every call, applies packed commits
    by unpacking from the slots it handed out."""

    verifies_copies = False

    def __init__(self, dst: KVRegions, slot_pages: int = 1 << 30, refuse_writes: bool = False) -> None:
        self.dst = dst
        self.slot_pages = slot_pages
        self.commits: list[Commit] = []
        self.slots: dict[int, torch.Tensor] = {}
        self.unreserved: list[int] = []
        self.writing_blocks = 0
        self.refuse = refuse_writes
        self.ended = False  # the receiver's record is terminal

    @contextlib.asynccontextmanager
    async def writing(self, out: Outgoing, target: Target) -> AsyncIterator[None]:
        if self.ended:
            raise Aborted("receiver ended")
        self.writing_blocks += 1
        yield

    async def batch_pages(self, out: Outgoing, target: Target, per_page: int, pages: int) -> int:
        return min(pages, self.slot_pages)

    async def reserve(self, out: Outgoing, target: Target, nbytes: int) -> Reserved:
        sid = len(self.slots) + 1
        self.slots[sid] = torch.zeros(nbytes, dtype=torch.uint8)
        if self.refuse:  # a slot elsewhere: the route must WRITE into it
            return Reserved(sid, 0, 0, "DRAM")
        return Reserved(sid, 0, 0, "DRAM", view=self.slots[sid])

    async def unreserve(self, out: Outgoing, target: Target, slot: Reserved) -> None:
        self.unreserved.append(slot.slot_id)

    async def write(self, *a: Any) -> None:
        raise TransportError("write refused")

    async def commit(
        self, out: Outgoing, target: Target, seq: int, c: Commit, slot: Reserved | None = None
    ) -> None:
        self.commits.append(c)
        if c.path == "PACKED" and c.positions.size:
            dst = target.dst_pages[c.positions - target.plan.prefix_pages]
            kernels.unpack(
                self.dst, self.slots[c.slot_id], dst, head_start=c.head_start, num_heads=c.num_heads
            )


def _setup(dst_pages: list[int], prefix: int = 0, mapped: bool = True, seed: int = 1) -> Any:
    src_r, dst_r = random_regions(LAYOUT, seed), random_regions(LAYOUT, seed + 100)
    plan = Plan(
        "t",
        "dst-bs",
        LAYOUT,
        prefix,
        np.asarray(dst_pages, dtype=np.int64),
        HeadRoute(0, 0, 0, 0, LAYOUT.local_kv_heads),
    )
    target = Target.of(plan, LAYOUT, dst_r if mapped else None)
    bs = types.SimpleNamespace(buffer_set_id="src-bs", layout=LAYOUT, lost=lambda: "")  # memory whole
    table = TransferTable(60.0)
    rec = Record("t", "SENDER", "src-bs", "s", time.monotonic() + 30)
    table.add(rec)
    out = Outgoing(rec, bs, "peer", "AUTO")  # type: ignore[arg-type]
    pool = StagingPool(1 << 20, "host")
    ctx = RouteContext(table, None, {"src-bs": src_r}, {}, lambda _bs: pool)  # type: ignore[arg-type]
    return types.SimpleNamespace(
        src=src_r, dst=dst_r, target=target, out=out, ctx=ctx, table=table, pool=pool
    )


def _chunk(src: list[int], last: bool = True, offset: int = 0, copied: Any = None) -> Chunk:
    return Chunk(0, offset, np.asarray(src, dtype=np.int64), last, {}, time.monotonic(), copied)


def test_fused_copies_every_page_and_commits_once_with_the_end() -> None:
    """FUSED: the named pages land byte-exact, others stay; one commit carries last and skipped."""
    s = _setup([5, 9, 2], prefix=1)
    before = pages_of(s.dst, LAYOUT, np.arange(32))
    chunk = _chunk([3, 7, 11, 13])  # position 0 is the receiver's prefix: skipped
    cmap = map_chunk(0, chunk.src, 1, s.target.dst_pages, s.target.units, True)
    port = FakePort(s.dst)
    asyncio.run(SameNodeRoute(s.ctx).move(port, s.out, s.target, chunk, cmap))
    for a, b in zip(
        pages_of(s.dst, LAYOUT, np.array([5, 9, 2])),
        pages_of(s.src, LAYOUT, np.array([7, 11, 13])),
        strict=True,
    ):
        assert torch.equal(a, b)
    untouched = np.setdiff1d(np.arange(32), [5, 9, 2])
    for a, b in zip(
        pages_of(s.dst, LAYOUT, untouched), [t[torch.as_tensor(untouched)] for t in before], strict=True
    ):
        assert torch.equal(a, b)
    (c,) = port.commits
    assert (c.path, c.last, c.skipped, c.positions.tolist()) == ("FUSED", True, 1, [1, 2, 3])
    assert c.nbytes == 3 * LAYOUT.page_bytes_all_layers and port.writing_blocks == 1


def test_fused_copies_nothing_once_the_receiver_ended() -> None:
    """The port refuses the write block: no byte lands, no commit is sent."""
    s = _setup([5, 9])
    before = pages_of(s.dst, LAYOUT, np.arange(32))
    chunk = _chunk([3, 7])
    cmap = map_chunk(0, chunk.src, 0, s.target.dst_pages, s.target.units, True)
    port = FakePort(s.dst)
    port.ended = True
    with pytest.raises(Aborted):
        asyncio.run(SameNodeRoute(s.ctx).move(port, s.out, s.target, chunk, cmap))
    assert not port.commits
    assert all(torch.equal(a, b) for a, b in zip(pages_of(s.dst, LAYOUT, np.arange(32)), before, strict=True))


def test_a_chunk_the_lane_copied_only_commits() -> None:
    """``chunk.copied``: no copy, no write block; the commit counts the lane's bytes."""
    s = _setup([5])
    before = pages_of(s.dst, LAYOUT, np.arange(32))
    chunk = _chunk([3], copied=(1234, 7))
    cmap = map_chunk(0, chunk.src, 0, s.target.dst_pages, s.target.units, True)
    port = FakePort(s.dst)
    asyncio.run(SameNodeRoute(s.ctx).move(port, s.out, s.target, chunk, cmap))
    assert all(torch.equal(a, b) for a, b in zip(pages_of(s.dst, LAYOUT, np.arange(32)), before, strict=True))
    (c,) = port.commits
    assert (c.nbytes, c.wire_us, port.writing_blocks) == (1234, 7, 0)


@pytest.mark.parametrize("slot_pages", [1, 3, 64])
def test_packed_batches_land_byte_exact_and_only_a_single_batch_ends_the_chunk(slot_pages: int) -> None:
    """PACKED: batches of at most ``slot_pages`` pages; the one-batch chunk ends in its commit."""
    dst = [20, 4, 17, 8, 30, 1, 12]
    s = _setup(dst)
    chunk = _chunk([2, 3, 5, 7, 11, 13, 19])
    cmap = map_chunk(0, chunk.src, 0, s.target.dst_pages, s.target.units, True)
    port = FakePort(s.dst, slot_pages=slot_pages)
    ended = asyncio.run(PackedRoute(s.ctx).move(port, s.out, s.target, chunk, cmap))
    for a, b in zip(pages_of(s.dst, LAYOUT, np.array(dst)), pages_of(s.src, LAYOUT, chunk.src), strict=True):
        assert torch.equal(a, b)
    batches = -(-len(dst) // slot_pages)
    assert len(port.commits) == batches and ended == (batches == 1)
    assert sorted(int(p) for c in port.commits for p in c.positions) == list(range(len(dst)))
    assert all(c.last == (batches == 1) for c in port.commits)
    assert s.pool.stats().slots_in_use == 0


def test_a_packed_batch_that_cannot_be_written_gives_its_room_back() -> None:
    """The write fails: every reserved slot is unreserved, nothing is committed, the error surfaces."""
    s = _setup([20, 4, 17])
    chunk = _chunk([2, 3, 5])
    cmap = map_chunk(0, chunk.src, 0, s.target.dst_pages, s.target.units, True)
    port = FakePort(s.dst, slot_pages=1, refuse_writes=True)
    with pytest.raises(TransportError):
        asyncio.run(PackedRoute(s.ctx).move(port, s.out, s.target, chunk, cmap))
    assert not port.commits and sorted(port.unreserved) == sorted(port.slots)
    assert s.pool.stats().slots_in_use == 0


def _target(mapped: bool, heads: int = 2, direct_ok: bool = True, page_size: int = 4) -> Target:
    dst_lay = small_layout(page_size)
    plan = Plan("t", "d", dst_lay, 0, np.arange(4), HeadRoute(0, 0, 0, 0, heads), direct_ok=direct_ok)
    return Target.of(plan, LAYOUT, random_regions(dst_lay, 0) if mapped else None)


@pytest.mark.parametrize(
    ("asked", "mapped", "kw", "want"),
    [
        ("AUTO", True, {}, "FUSED"),
        ("PACKED", True, {}, "PACKED"),
        ("DIRECT", True, {}, "FUSED"),
        ("AUTO", False, {}, "AUTO"),
        ("AUTO", False, {"heads": 1}, "PACKED"),
        ("AUTO", False, {"direct_ok": False}, "PACKED"),
        ("AUTO", False, {"page_size": 8}, "PACKED"),
        ("DIRECT", False, {}, "DIRECT"),
        ("PACKED", False, {}, "PACKED"),
    ],
)
def test_the_path_follows_the_mapping_and_what_was_asked(
    asked: str, mapped: bool, kw: Any, want: str
) -> None:
    """Mapped pools copy (FUSED) unless PACKED was asked; AUTO defers to the calibration only for
    full-head, same-layout, registered pools."""
    assert path_of(asked, _target(mapped, **kw), True, "peer") == want


@pytest.mark.parametrize(
    ("asked", "kw", "registered", "words"),
    [
        ("FUSED", {}, True, "FUSED needs the receiver's pools mapped"),
        ("DIRECT", {"heads": 1}, True, "cannot slice heads"),
        ("DIRECT", {"page_size": 8}, True, "the kernels convert"),
        ("DIRECT", {}, False, "registered with the transport"),
        ("DIRECT", {"direct_ok": False}, True, "registered with the transport"),
    ],
)
def test_an_impossible_path_is_refused_with_the_reason(
    asked: str, kw: Any, registered: bool, words: str
) -> None:
    """FAILED_PRECONDITION naming why the asked path cannot be taken."""
    with pytest.raises(FailedPrecondition, match=words):
        path_of(asked, _target(False, **kw), registered, "peer")
