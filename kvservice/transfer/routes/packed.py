"""PACKED route: pages packed into staging batches, unpacked by the receiver at commit.

    per batch (PIPELINE batches in reserve → pack → write at once):
      port.reserve ─▶ a credit / slot of the receiver's staging
      pack (head slice, receiver's units and page order) ─▶ our staging slot ─▶ WRITE ─▶ theirs
        or, the receiver's slot mapped here on the same device: pack straight into it (no WRITE)
        or, mapped on another device: one device-to-device copy
      port.commit(PACKED) ─▶ the receiver unpacks it (outside the window: overlaps later batches)

A chunk ends when every commit was acknowledged. One batch (every small delta) ends the chunk in
its own commit (``last``, skipped pages): one control round trip fewer (data path v3 §3). Of
several batches none carries the end: the receiver checks a sender's coverage when its end
arrives, and their commits may be applied in any order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np

from ... import kernels
from ...kernels.streams import on_side_stream
from .. import trace
from ..integrity import pack_hashed
from ..peer_channel import WINDOW
from ..plan import ChunkMap
from ..port import ReceiverPort
from ..sender import Chunk, Outgoing, check_live
from ..values import Commit, Target
from . import RouteContext, commit

__all__ = ["PIPELINE", "PackedRoute"]

log = logging.getLogger(__name__)

# NOTE: as many batches of one chunk in flight as a peer channel holds credits (WINDOW): with 3,
# the fourth credit sat idle while the first batch waited for its write (H200 timeline, 2 GiB
# cross-node on one GPU).
PIPELINE = WINDOW


def _trace_batch(out: Outgoing, first: int, nbytes: int, times: tuple[float, ...]) -> None:
    """DEBUG: one packed batch's timeline (``bench_transfer --timeline`` draws it).

    ``t``: CLOCK_MONOTONIC seconds (one clock for every process of a host) at: chunk queued,
    batch started (staging asked for), slot held, packed, written, committed.
    ``first``: the batch's first sequence position, which the receiver's "unpacked batch" names.
    """
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "packed batch",
            extra={
                "transfer_id": out.rec.transfer_id,
                "first": int(first),
                "bytes": nbytes,
                "t": list(times),
            },
        )


def _copy(dst: Any, src: Any) -> None:
    on_side_stream(dst.device, lambda: dst.copy_(src, non_blocking=True))


class PackedRoute:
    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx

    async def move(
        self, port: ReceiverPort, out: Outgoing, target: Target, chunk: Chunk, cmap: ChunkMap
    ) -> bool:
        """Move the chunk in batches that fit a staging slot; True if the commit of its only
        batch also carried the chunk's end (no marker commit follows)."""
        regions = self.ctx.kv_regions[out.bs.buffer_set_id]
        pool = self.ctx.pool_for(out.bs)
        per_page = kernels.packed_nbytes(regions, 1, target.route.num_heads, unit=target.units.tokens)
        batch = max(1, min(cmap.num_pages, (pool.capacity_bytes // (PIPELINE + 1)) // per_page))
        batch = await port.batch_pages(out, target, per_page, batch)
        ends = cmap.num_pages <= batch and chunk.last and not chunk.aux
        end = (True, cmap.skipped) if ends else (False, 0)
        window = asyncio.Semaphore(PIPELINE)
        commits: list[asyncio.Future[None]] = []
        failed: list[BaseException] = []

        async def one(start: int) -> None:
            async with window:
                if failed:  # a sibling failed: start nothing new
                    return
                try:
                    done = await self._batch(port, out, target, chunk, cmap, start, batch, per_page, end)
                except BaseException as exc:
                    failed.append(exc)
                    raise
            commits.append(asyncio.ensure_future(done))

        # NOTE: every batch runs to a settled end (no cancellation mid-write), then errors surface.
        await asyncio.gather(*(one(s) for s in range(0, cmap.num_pages, batch)), return_exceptions=True)
        results = await asyncio.gather(*commits, return_exceptions=True)
        errors = failed + [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return ends

    async def _batch(
        self,
        port: ReceiverPort,
        out: Outgoing,
        target: Target,
        chunk: Chunk,
        cmap: ChunkMap,
        start: int,
        batch: int,
        per_page: int,
        end: tuple[bool, int],
    ) -> Coroutine[Any, Any, None]:
        """Reserve, pack and write one batch; returns its commit (which carries ``end`` = the
        chunk's ``last`` and skipped pages when it ends the chunk)."""
        plan = target.plan
        regions = self.ctx.kv_regions[out.bs.buffer_set_id]
        pool = self.ctx.pool_for(out.bs)
        src = cmap.src[start : start + batch]
        nbytes = per_page * src.size
        check_live(out)
        t_start = time.monotonic()
        slot = await port.reserve(out, target, nbytes)
        try:
            if slot.view is not None and slot.view.device == regions.device:
                # the receiver's slot is mapped here, same device: pack straight into it, no wire
                check_live(out)
                t0 = time.monotonic()
                check = await pack_hashed(plan, target, regions, src, slot.view)
                t1 = time.monotonic()
            else:
                async with pool.slot(nbytes, out.rec.deadline) as mine:
                    check_live(out)
                    t0 = time.monotonic()
                    staged = pool.view(mine)[:nbytes]
                    check = await pack_hashed(plan, target, regions, src, staged)
                    t1 = time.monotonic()
                    trace.mark(out.rec.transfer_id, "packed")
                    if slot.view is not None:  # mapped on another device: one device-to-device copy
                        await asyncio.to_thread(_copy, slot.view, staged)
                    else:
                        local = np.array([[mine.addr, nbytes, pool.device]], dtype=np.int64)
                        remote = np.array([[slot.address, nbytes, slot.device]], dtype=np.int64)
                        await port.write(
                            out, local, remote, "VRAM" if pool.kind == "vram" else "DRAM", slot.mem_kind
                        )
            t2 = time.monotonic()
            trace.mark(out.rec.transfer_id, "written")
        except BaseException:
            await port.unreserve(out, target, slot)
            raise
        c = Commit(
            cmap.positions[start : start + batch],
            "PACKED",
            target.route.dst_head_start,
            target.route.num_heads,
            nbytes=nbytes,
            skipped=end[1],
            descriptors=1,
            slot_id=slot.slot_id,
            credit=slot.credit is not None,
            last=end[0],
            pack_us=int((t1 - t0) * 1e6),
            wire_us=int((t2 - t1) * 1e6),
            check=check,
        )

        async def committed() -> None:
            await commit(self.ctx, port, out, target, chunk.seq, c, slot)
            _trace_batch(
                out, cmap.positions[start], nbytes, (chunk.queued, t_start, t0, t1, t2, time.monotonic())
            )

        return committed()
