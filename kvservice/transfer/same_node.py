"""Same-node fused route: both pools are mapped in this service, so a chunk is one fused copy.

    SendDelta chunk ─▶ map positions (plan.py) ─▶ copy_pages(src pages ─▶ dst pages, head slice)
                    ─▶ Engine.commit (receiver accounting, DONE, publish)      no staging, no RPC

Per receiver rank one call (one kernel launch on CUDA, one compiled loop on the CPU). CUDA
launches go on a service-owned stream of the source device and completion is an event that a
completion thread waits for (``streams.run_on_device``: the loop never polls); host pools copy in
a worker thread (the compiled loop releases the GIL), or inline when the copy is small
(``INLINE_BYTES``) and the compiled loop is ready (the event loop never waits for the JIT). The
receiver's declaration is held ``busy`` while a copy runs, so an Abort returns only after it
ended, and a copy never starts once the receiver's record is terminal: no byte lands after an
acknowledged Abort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np

from ..errors import Aborted
from ..kernels import KVRegions, _fused_cpu
from ..kernels.fused import copy_pages, fused_nbytes
from ..kernels.streams import on_side_stream, run_on_device
from . import trace
from .plan import ChunkMap
from .sender import Outgoing, Target

__all__ = ["SameNode"]

log = logging.getLogger(__name__)

# NOTE: host copies up to this size run on the event loop (≤ ~0.2 ms of copying), where handing
# them to a worker thread cost 0.15-7 ms of wake-up on the 2-core VM (bench_transfer --same-node,
# 1 MiB delta: 10.9 ms through a thread).
INLINE_BYTES = 2 << 20


class SameNode:
    def __init__(self, engine: Any) -> None:
        self.e = engine
        self._peer_ok: dict[tuple[int, int], bool] = {}

    async def move(
        self,
        out: Outgoing,
        target: Target,
        cmap: ChunkMap,
        last: bool,
        aux: tuple[int, int] = (0, 0),
        copied: tuple[int, int] | None = None,
    ) -> None:
        """Copy the chunk's pages into the receiver rank's pages, then commit them there: one
        commit that also carries the chunk's end (``last``, its skipped pages, ``aux`` = the
        bytes and rows of aux already written). ``copied``: the native lane made the copy
        (bytes, µs); only the commit is left."""
        e = self.e
        inc = e.receiver.get(out.rec.transfer_id, target.plan.dst_buffer_set_id)
        route = target.route
        if copied is not None:
            nbytes, us = copied
        else:
            src = e.kv_regions[out.bs.buffer_set_id]
            dst = e.regions_of(inc)
            e.sender.check_live(out)
            if inc.rec.terminal:
                raise Aborted(f"transfer {inc.rec.transfer_id!r} is {inc.rec.state}: {inc.rec.error}")
            inc.busy += 1  # from here an abort of the receiver waits until the copy ended
            t0 = time.monotonic()
            try:
                trace.mark(out.rec.transfer_id, "copy_start")
                nbytes = await self.copy(src, dst, cmap.src, cmap.dst, target)
                trace.mark(out.rec.transfer_id, "copy_done")
            finally:
                inc.busy -= 1
            us = int((time.monotonic() - t0) * 1e6)
        e.table.update(
            out.rec, path="FUSED", add_bytes_sent=nbytes + aux[0], add_descriptors=aux[1], add_wire=us
        )
        await e.commit(
            inc,
            f"{e.service_id}/{out.bs.layout.tp_rank}",
            cmap.positions,
            last=last,
            nbytes=nbytes + aux[0],
            skipped=cmap.skipped,
            aux=aux[1] > 0,
            primary=route.dst_head_start == 0,
            path="FUSED",
            wire_us=us,
            descriptors=aux[1],
        )

    async def copy(
        self, src: KVRegions, dst: KVRegions, sp: np.ndarray, dp: np.ndarray, target: Target
    ) -> int:
        """One fused copy of ``target``'s head slice, in its units; returns when the bytes are in
        ``dst`` (never blocks the loop)."""
        route = target.route
        unit = target.units.tokens
        kw = {
            "src_head_start": route.src_head_start,
            "dst_head_start": route.dst_head_start,
            "num_heads": route.num_heads,
            "unit": unit,
        }
        sd, dd = src.device, dst.device
        if sd.type == "cuda" and dd.type == "cuda" and self._enable_peer(sd.index, dd.index):
            return await run_on_device(sd, "copy", lambda: copy_pages(src, dst, sp, dp, **kw))  # type: ignore[arg-type]
        if sd.type == "cuda" or dd.type == "cuda":  # host <-> device pool, or GPUs without P2P
            dev = sd if sd.type == "cuda" else dd
            return await asyncio.to_thread(
                on_side_stream,
                dev,
                lambda: copy_pages(src, dst, sp, dp, backend="torch", **kw),  # type: ignore[arg-type]
            )
        if fused_nbytes(src, int(sp.size), route.num_heads, unit) <= INLINE_BYTES and _fused_cpu.ready():
            return copy_pages(src, dst, sp, dp, **kw)  # type: ignore[arg-type]
        return await asyncio.to_thread(copy_pages, src, dst, sp, dp, **kw)  # type: ignore[arg-type]

    def _enable_peer(self, a: int, b: int) -> bool:
        """Peer access from device ``a`` to ``b``, enabled once (lazily, on the first copy)."""
        if a == b:
            return True
        ok = self._peer_ok.get((a, b))
        if ok is None:
            from kvservice_client import cuda_ipc

            ok = self._peer_ok[(a, b)] = cuda_ipc.enable_peer_access(a, b)
            if not ok:
                log.warning(
                    "no peer access from cuda:%d to cuda:%d: same-node copies between them go through "
                    "torch (gather, device copy, scatter)",
                    a,
                    b,
                )
        return ok
