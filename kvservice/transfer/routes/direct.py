"""DIRECT route: page descriptors written straight into the receiver's pages, then one commit.

    local list (prepped per buffer set at registration) ─┐
                                                          ├─ prepped_indices ─▶ one WRITE ─▶ commit
    the receiver's list (prepped per peer × buffer set) ──┘

No staging and no kernel: for full-head, same-layout moves where the descriptor count is low
enough that the transport beats pack + one WRITE (descriptors.choose_path).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from ..descriptors import prepped_indices
from ..integrity import pages_check
from ..plan import ChunkMap
from ..port import ReceiverPort
from ..sender import Chunk, Outgoing
from ..values import Commit, Target
from ..writes import wait_write
from . import RouteContext, commit

__all__ = ["DirectRoute"]


class DirectRoute:
    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx

    async def move(
        self,
        port: ReceiverPort,
        out: Outgoing,
        target: Target,
        chunk: Chunk,
        cmap: ChunkMap,
        aux: tuple[int, int] = (0, 0),
    ) -> None:
        """WRITE the chunk's pages, then commit them with the chunk's end (``aux``: the bytes and
        rows of aux already written)."""
        bs, plan = out.bs, target.plan
        remote = await port.remote_pages(plan)
        pb = np.array([r.size for r in bs.regions], dtype=np.int64) // bs.layout.num_pages
        idx = prepped_indices(
            len(bs.regions), cmap.src, cmap.dst, bs.layout.num_pages, plan.dst_layout.num_pages, pb
        )
        local = self.ctx.local_lists[bs.buffer_set_id]
        t0 = time.monotonic()
        h = await asyncio.to_thread(
            self.ctx.transport.write, local, idx.local_idx, remote, idx.remote_idx, None
        )
        await wait_write(self.ctx.transport, out, h)
        wire = int((time.monotonic() - t0) * 1e6)
        check = await pages_check(plan, self.ctx.kv_regions[bs.buffer_set_id], cmap.src, target)
        c = Commit(
            cmap.positions,
            "DIRECT",
            target.route.dst_head_start,
            target.route.num_heads,
            nbytes=idx.total_bytes + aux[0],
            skipped=cmap.skipped,
            descriptors=idx.count + aux[1],
            aux=aux[1] > 0,
            last=chunk.last,
            wire_us=wire,
            check=check,
        )
        await commit(self.ctx, port, out, target, chunk.seq, c)
