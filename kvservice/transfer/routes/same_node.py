"""FUSED route: the receiver rank's pools are mapped here, so a chunk is one fused copy.

    chunk ─▶ map positions (plan.py) ─▶ copy_pages(src pages ─▶ dst pages, head slice, units)
          ─▶ port.commit(FUSED, with the chunk's end)                  no staging, no WRITE

The pools are this service's own (the receiver is a session of this service) or a same-host
service's, opened here through their CUDA IPC / shm handles (peer_pools.py). Per receiver rank one
call: one kernel launch on one GPU; between two GPUs one kernel across the link, on the source GPU
(push) or the destination's (pull), with the other GPU's pools opened a second time in the
launching GPU's context (``buffers.memory.alias_addresses``), or pack / link copy / unpack in
chunks (kernels/across.py, ``two_gpu_copy = staged``); one compiled loop on the CPU. CUDA launches
go on a service-owned stream of the launching device and completion is an event a completion
thread waits for (``streams.run_on_device``: the loop never polls); host pools copy in a worker
thread (the compiled loop releases the GIL), or inline when the copy is small (``INLINE_BYTES``)
and the compiled loop is ready (the event loop never waits for the JIT). The copy runs inside the
port's ``writing`` block: on this service an Abort of the receiver returns only after the copy
ended, and no copy starts once the receiver's record is terminal.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from ...buffers.memory import alias_addresses
from ...kernels import KVRegions, _fused_cpu
from ...kernels.across import copy_across
from ...kernels.fused import copy_pages, fused_nbytes
from ...kernels.streams import on_side_stream, run_on_device, service_stream
from .. import trace
from ..integrity import pages_check
from ..plan import ChunkMap
from ..port import ReceiverPort
from ..sender import Chunk, Outgoing, check_live
from ..values import Commit, Target
from . import RouteContext, commit

__all__ = ["INLINE_BYTES", "TWO_GPU_STAGED_FROM", "SameNodeRoute"]

log = logging.getLogger(__name__)

# NOTE: host copies up to this size run on the event loop (≤ ~0.2 ms of copying), where handing
# them to a worker thread cost 0.15-7 ms of wake-up on the 2-core VM (bench_transfer --same-node,
# 1 MiB delta: 10.9 ms through a thread).
INLINE_BYTES = 2 << 20

# NOTE: Config.tuning.two_gpu_copy "auto" on this route (2×H200, bench_transfer --src-gpu 0 --dst-gpu 1
# --same-node --no-lane): for 2 GiB the staged copy's link copies run at
# the copy engines' rate and beat one Triton kernel across the link (copy phase 6.46 ms staged,
# 6.89 pull, 7.03 push); one 64 KiB page is one launch across the link instead of three launches
# and a copy (0.65 ms push, 0.72 pull, 0.88 staged).
TWO_GPU_STAGED_FROM = 64 << 20  # bytes
TWO_GPU_SMALL = "push"


def _across_link(src: KVRegions, dst: KVRegions, push: bool) -> tuple[KVRegions, KVRegions] | None:
    """The two pools as one kernel reaches them: on the source GPU (``push``, the destination
    aliased there) or the destination GPU (pull); None when the other GPU's pools cannot be
    mapped into the launching GPU's context (docs/decisions/0017)."""
    far, here = (dst, src) if push else (src, dst)
    there = far.on_device(here.device, alias_addresses)
    if there is None:
        return None
    return (src, there) if push else (there, dst)


class SameNodeRoute:
    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx
        self._peer_ok: dict[tuple[int, int], bool] = {}

    async def move(
        self,
        port: ReceiverPort,
        out: Outgoing,
        target: Target,
        chunk: Chunk,
        cmap: ChunkMap,
        aux: tuple[int, int] = (0, 0),
    ) -> None:
        """Copy the chunk's pages into the receiver rank's pages, then commit them there: one
        commit that also carries the chunk's end (``last``, its skipped pages, ``aux`` = the
        bytes and rows of aux already written). A chunk the native lane copied
        (``chunk.copied``: bytes, µs) only commits."""
        dst = target.dst_regions
        assert dst is not None
        check = None
        if chunk.copied is not None:
            nbytes, us = chunk.copied
        else:
            src = self.ctx.kv_regions[out.bs.buffer_set_id]
            check_live(out)
            async with port.writing(out, target):
                t0 = time.monotonic()
                trace.mark(out.rec.transfer_id, "copy_start")
                nbytes = await self.copy(src, dst, cmap.src, cmap.dst, target)
                trace.mark(out.rec.transfer_id, "copy_done")
            us = int((time.monotonic() - t0) * 1e6)
            if port.verifies_copies:
                check = await pages_check(target.plan, src, cmap.src, target)
        c = Commit(
            cmap.positions,
            "FUSED",
            target.route.dst_head_start,
            target.route.num_heads,
            nbytes=nbytes + aux[0],
            skipped=cmap.skipped,
            descriptors=aux[1],
            aux=aux[1] > 0,
            last=chunk.last,
            wire_us=us,
            check=check,
        )
        await commit(self.ctx, port, out, target, chunk.seq, c)

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
        if sd.type == "cuda" and dd.type == "cuda" and sd.index == dd.index:
            return await run_on_device(sd, "copy", lambda: copy_pages(src, dst, sp, dp, **kw))  # type: ignore[arg-type]
        if sd.type == "cuda" and dd.type == "cuda":
            peer = self._enable_peer(sd.index, dd.index)  # NVLink / PCIe P2P for either way
            mode = self.ctx.two_gpu_copy
            if mode == "auto":
                big = fused_nbytes(src, int(sp.size), route.num_heads, unit) >= TWO_GPU_STAGED_FROM
                mode = "staged" if big else TWO_GPU_SMALL
            if peer and mode in ("push", "pull"):  # one fused kernel across the link
                pair = _across_link(src, dst, push=mode == "push")
                if pair is not None:
                    s2, d2 = pair
                    return await run_on_device(s2.device, "copy", lambda: copy_pages(s2, d2, sp, dp, **kw))  # type: ignore[arg-type]
            # pack, link copy, unpack (across.py)
            pack_s, link_s = service_stream(sd.index, "pack-across"), service_stream(sd.index, "link")
            return await run_on_device(  # type: ignore[no-any-return]
                dd,
                "copy",
                lambda: copy_across(src, dst, sp, dp, pack_stream=pack_s, link_stream=link_s, **kw),  # type: ignore[arg-type]
            )
        if sd.type == "cuda" or dd.type == "cuda":  # host <-> device pool
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
                    "host memory (the driver stages the link copy)",
                    a,
                    b,
                )
        return ok
