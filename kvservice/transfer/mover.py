"""The bytes of a chunk: receive plans, direct and packed moves, commits, aborts to peers.

Direct: one prepped descriptor list per local buffer set (made at registration) and one per
(peer, receiver buffer set) made on first use; a chunk is two index arrays into them
(``descriptors.prepped_indices``). Packed: ``kernels.pack`` into a slot of our staging pool,
one WRITE into the slot the receiver reserved, CommitChunk makes the receiver unpack. Chunks
larger than a staging slot are moved in batches of pages that fit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np
from kvservice_client import Layout
from kvservice_client._proto import common_pb2, peer_pb2

from .. import host, kernels
from ..buffers import BufferSet
from ..errors import DeadlineExceeded, FailedPrecondition, NotFound
from ..identity import LOCAL_PEER
from ..kernels import KVRegions
from ..kernels.heads import HeadRoute
from ..kernels.streams import on_side_stream
from . import trace
from .descriptors import choose_path, prepped_indices, prepped_rows
from .integrity import Check, pack_hashed, pages_check
from .peer_channel import OutboundChannel
from .peer_pools import PeerPools
from .peers import PeerDirectory, error_from_code
from .plan import ChunkMap
from .receiver import plan_message
from .same_node import SameNode
from .sender import Chunk, Outgoing, Target
from .transport import RemoteDescList, Transport, XferHandle

__all__ = ["Mover"]

log = logging.getLogger(__name__)


def _trace_batch(out: Outgoing, first: int, nbytes: int, times: tuple[float, ...]) -> None:
    """DEBUG: one packed batch's timeline (``bench_transfer --timeline`` draws it).

    ``t``: CLOCK_MONOTONIC seconds (one clock for every process of a host) at: chunk queued,
    batch started (staging asked for), slot held, packed, written, committed or handed on.
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


_PATH_PB = {
    "DIRECT": common_pb2.TRANSFER_PATH_DIRECT,
    "PACKED": common_pb2.TRANSFER_PATH_PACKED,
    "FUSED": common_pb2.TRANSFER_PATH_FUSED,
}
INLINE_POST_ROWS = 64  # WRITEs of at most this many rows are posted on the loop (see _post_write)
PIPELINE = 3  # packed batches of one chunk in flight at once


def _copy(dst: Any, src: Any) -> None:
    on_side_stream(dst.device, lambda: dst.copy_(src, non_blocking=True))


class Mover:
    def __init__(self, engine: Any) -> None:
        self.e = engine
        self.transport: Transport = engine.transport
        self.peers: PeerDirectory = engine.peers
        self._remote_lists: dict[tuple[str, str, int], RemoteDescList] = {}
        self.same_node = SameNode(engine)
        self.peer_pools = PeerPools()
        self.channels: dict[str, OutboundChannel] = {}
        self._noted: set[tuple[str, str]] = set()  # (peer, reason) of same-host refusals logged

    def _channel(self, peer: Any) -> OutboundChannel | None:
        """The persistent channel to a receiving service (None: same service, or an older peer)."""
        if peer.is_self or "channel" not in peer.capabilities:
            return None
        chan = self.channels.get(peer.address)
        if chan is None:
            chan = self.channels[peer.address] = OutboundChannel(
                peer.address, lambda: peer.stub, (self.e.service_id, self.e.address)
            )
        return chan

    async def close_channels(self) -> None:
        for chan in self.channels.values():
            await chan.close()
        self.channels.clear()

    # -- plans -------------------------------------------------------------------------------
    async def fetch_targets(self, out: Outgoing) -> list[Target]:
        peer = self.peers.get(out.peer_address)
        await peer.refresh(timeout=self._left(out))
        if peer.is_self:  # the receiver's declarations live here: no request, no page list to copy
            return await self._local_targets(out)
        same_host = (
            self.e.config.same_host_route == "auto" and bool(peer.boot_id) and peer.boot_id == host.boot_id()
        )
        req = peer_pb2.GetReceivePlanRequest(
            transfer_id=out.rec.transfer_id,
            sender_service_id=self.e.service_id,
            src_layout=out.bs.layout.to_proto(),
            wait_ms=int(self._left(out) * 1000),
            sender_address=self.e.address,
            sender_boot_id=host.boot_id() if same_host else "",
        )
        chan = self._channel(peer)
        trace.mark(out.rec.transfer_id, "plan_asked")
        try:
            if chan is not None:  # one message each way on the open channel
                resp = await chan.plans(req, self._left(out) + 1.0)
            else:
                resp = await peer.call("GetReceivePlan", req, self._left(out) + 1.0)
            trace.mark(out.rec.transfer_id, "plan_got")
        except NotFound as exc:
            if time.monotonic() >= out.rec.deadline - 0.05:  # the wait was bounded by our deadline
                raise DeadlineExceeded(f"transfer deadline passed: {exc.message}") from None
            raise
        await peer.refresh(min_epoch=resp.metadata_epoch, timeout=self._left(out))
        targets = []
        for plan in resp.plans:
            r = plan.route
            route = HeadRoute(
                out.bs.layout.tp_rank,
                plan.dst_layout.tp_rank,
                r.src_head_start,
                r.dst_head_start,
                r.num_heads,
            )
            mapped = self._same_host(out, peer, plan) if same_host else None
            dst_pages = np.asarray(plan.dst_page_indices, dtype=np.int64)
            targets.append(
                Target.for_layouts(
                    plan, dst_pages, route, out.bs.layout, Layout.from_proto(plan.dst_layout), mapped
                )
            )
        return targets

    def _same_host(self, out: Outgoing, peer: Any, plan: peer_pb2.ReceivePlan) -> KVRegions | None:
        """The receiver rank's pools mapped here, or None with the reason noted (logged once)."""
        why = plan.same_host_refusal
        if not why and not plan.kv_handles:
            why = "the receiver sent no pool handles (an older service?)"
        if not why:
            try:
                return self.peer_pools.open(peer.service_id, plan)
            except FailedPrecondition as exc:
                why = exc.message
        note = f"same-host fused route not taken ({why}); pages go through the transport"
        self.e.table.update(out.rec, route_note=note)
        if (peer.service_id, why) not in self._noted:
            self._noted.add((peer.service_id, why))
            log.warning(note, extra={"peer": out.peer_address, "transfer_id": out.rec.transfer_id})
        return None

    async def _local_targets(self, out: Outgoing) -> list[Target]:
        lay = out.bs.layout
        tid = out.rec.transfer_id
        if not out.via_lane:  # the native lane may hold it (kvservice.lane): disarm, or refuse
            self.e.lane.gate(tid)
        try:
            found = await self.e.receiver.plans(
                tid, lay, self.e.service_id, self.e.address, self._left(out), LOCAL_PEER
            )
        except NotFound as exc:
            raise DeadlineExceeded(f"transfer deadline passed: {exc.message}") from None
        if not out.via_lane:  # a declaration armed while we waited
            self.e.lane.gate(tid)
        return [
            Target.for_layouts(
                plan_message(
                    inc,
                    route,
                    inc.bs.buffer_set_id not in self.e.no_direct,
                    False,
                    f"{self.e.service_id}/{lay.tp_rank}",
                ),
                inc.dst_pages,
                route,  # plan_heads' route of this sender rank to that receiver rank, as is
                lay,
                inc.bs.layout,
            )
            for inc, route in found
        ]

    # -- moving a chunk ----------------------------------------------------------------------
    async def move(self, out: Outgoing, target: Target, chunk: Chunk, cmap: ChunkMap) -> None:
        path = out.path
        same = self.peers.get(out.peer_address).is_self
        if cmap.num_pages:
            direct_ok = (
                target.plan.direct_ok and out.bs.buffer_set_id not in self.e.no_direct and not target.converts
            )
            if same or target.dst_regions is not None:  # both pools mapped here: fused, unless
                path = "PACKED" if path == "PACKED" else "FUSED"  # PACKED (staged) was asked for
            elif path == "FUSED":
                raise FailedPrecondition(
                    f"path: FUSED needs the receiver's pools mapped here; {out.peer_address}: "
                    f"{out.rec.route_note or 'another host'}"
                )
            if path == "AUTO":
                path = self._choose(out.bs, cmap.num_pages) if target.full_heads and direct_ok else "PACKED"
            elif path == "DIRECT" and not target.full_heads:
                raise FailedPrecondition("path: DIRECT cannot slice heads (mixed TP); use AUTO or PACKED")
            elif path == "DIRECT" and target.converts:
                raise FailedPrecondition(
                    "path: DIRECT copies pages as they are; the receiver's page size or page layout "
                    "differs (the kernels convert): use AUTO or PACKED"
                )
            elif path == "DIRECT" and not direct_ok:
                raise FailedPrecondition(
                    "path: DIRECT needs both pools registered with the transport; use AUTO"
                )
            self.e.table.update(out.rec, path=path)
            if path in ("DIRECT", "FUSED") and not same:  # one commit carries the chunk's end too
                aux = await self._aux(out, target, chunk) if chunk.last and chunk.aux else (0, 0)
                mover = self._direct if path == "DIRECT" else self._fused_remote
                await mover(out, target, chunk, cmap, aux)
                return
            if path == "FUSED":  # same service: one commit carries the chunk's end too
                aux = await self._aux(out, target, chunk) if chunk.last and chunk.aux else (0, 0)
                await self.same_node.move(out, target, cmap, chunk.last, aux, chunk.copied)
                return
            elif await self._packed(out, target, chunk, cmap):
                return  # its one batch's commit carried the chunk's end
        aux_bytes, aux_descs = await self._aux(out, target, chunk) if chunk.last and chunk.aux else (0, 0)
        if chunk.last or cmap.skipped:  # a marker: skipped pages, the sender's end, aux delivered
            await self._commit(
                out,
                target,
                chunk,
                cmap.positions[:0],
                aux_bytes,
                cmap.skipped,
                aux_descs,
                "DIRECT",
                0,
                aux_descs > 0,
                last=chunk.last,
            )

    async def _fused_remote(
        self, out: Outgoing, target: Target, chunk: Chunk, cmap: ChunkMap, aux: tuple[int, int]
    ) -> None:
        """Same host, another service: copy into its mapped pools, then commit (FUSED) with the
        chunk's end (skipped pages, aux rows written, last) in the same message."""
        assert target.dst_regions is not None
        self.e.sender.check_live(out)
        t0 = time.monotonic()
        src = self.e.kv_regions[out.bs.buffer_set_id]
        nbytes = await self.same_node.copy(src, target.dst_regions, cmap.src, cmap.dst, target)
        us = int((time.monotonic() - t0) * 1e6)
        check = await pages_check(target.plan, src, cmap.src, target)
        await self._commit(
            out,
            target,
            chunk,
            cmap.positions,
            nbytes + aux[0],
            cmap.skipped,
            aux[1],
            "FUSED",
            0,
            aux[1] > 0,
            wire_us=us,
            last=chunk.last,
            check=check,
        )

    def _choose(self, bs: BufferSet, num_pages: int) -> str:
        regions = len(bs.regions)
        descs = regions * num_pages
        total = num_pages * bs.layout.page_bytes_all_layers
        kind = (
            f"nixl-{'vram' if bs.memory == 'cuda_ipc' else 'dram'}"
            if self.transport.kind == "nixl"
            else self.transport.kind
        )
        return choose_path(descs, total, kind, self.e.calibration).upper()

    async def _direct(
        self, out: Outgoing, target: Target, chunk: Chunk, cmap: ChunkMap, aux: tuple[int, int]
    ) -> None:
        bs, plan = out.bs, target.plan
        peer = self.peers.get(out.peer_address)
        local = self.e.local_lists[bs.buffer_set_id]
        key = (peer.service_id, plan.dst_buffer_set_id, peer.epoch)
        remote = self._remote_lists.get(key)
        if remote is None:
            rows = prepped_rows(
                np.array([r.address for r in plan.kv_regions], dtype=np.int64),
                np.array(
                    [r.size_bytes // plan.dst_layout.num_pages for r in plan.kv_regions], dtype=np.int64
                ),
                plan.dst_layout.num_pages,
                plan.kv_regions[0].device_id,
            )
            remote = await asyncio.to_thread(
                self.transport.prep_remote, peer.agent, rows, plan.kv_regions[0].mem_kind
            )
            self._remote_lists[key] = remote
        pb = np.array([r.size for r in bs.regions], dtype=np.int64) // bs.layout.num_pages
        idx = prepped_indices(
            len(bs.regions), cmap.src, cmap.dst, bs.layout.num_pages, plan.dst_layout.num_pages, pb
        )
        t0 = time.monotonic()
        h = await asyncio.to_thread(self.transport.write, local, idx.local_idx, remote, idx.remote_idx, None)
        await self._await(out, h)
        wire = int((time.monotonic() - t0) * 1e6)
        check = await pages_check(plan, self.e.kv_regions[bs.buffer_set_id], cmap.src, target)
        await self._commit(
            out,
            target,
            chunk,
            cmap.positions,
            idx.total_bytes + aux[0],
            cmap.skipped,
            idx.count + aux[1],
            "DIRECT",
            0,
            aux[1] > 0,
            wire_us=wire,
            last=chunk.last,
            check=check,
        )

    async def _packed(self, out: Outgoing, target: Target, chunk: Chunk, cmap: ChunkMap) -> bool:
        """Move the chunk in batches that fit a staging slot; True if the commit of its only
        batch also carried the chunk's end (``last``, skipped pages: no marker commit follows).

        ``PIPELINE`` batches are in reserve → pack → wire at once; a batch's CommitChunk (the
        receiver's unpack) runs outside that window, so it overlaps the next batches. The chunk
        ends when every commit was acknowledged. (Of several batches none may carry the end: the
        receiver checks a sender's coverage when its end arrives, and their commits may be
        applied in any order.)
        """
        regions = self.e.kv_regions[out.bs.buffer_set_id]
        pool = self.e.pool_for(out.bs)
        per_page = kernels.packed_nbytes(regions, 1, target.route.num_heads, unit=target.units.tokens)
        batch = max(1, min(cmap.num_pages, (pool.capacity_bytes // (PIPELINE + 1)) // per_page))
        chan = self._channel(self.peers.get(out.peer_address))
        if chan is not None:
            credit_bytes = await chan.slot_size(self._credit_key(target), out.rec.deadline)
            if credit_bytes < per_page:
                chan = None  # a page does not fit the receiver's credit slots: reserve per batch
            else:
                batch = min(batch, credit_bytes // per_page)
        # NOTE: one batch (every small delta) ends the chunk in its own commit: one control round
        # trip fewer on the critical path (data path v3 §3).
        ends = cmap.num_pages <= batch and chunk.last and not chunk.aux
        end = (True, cmap.skipped) if ends else (False, 0)
        window = asyncio.Semaphore(PIPELINE)
        commits: list[asyncio.Task[None]] = []
        failed: list[BaseException] = []

        async def one(start: int) -> None:
            async with window:
                if failed:  # a sibling failed: start nothing new
                    return
                try:
                    commit = await self._packed_batch(
                        out, target, chunk, cmap, start, batch, per_page, chan, end
                    )
                except BaseException as exc:
                    failed.append(exc)
                    raise
            commits.append(asyncio.ensure_future(commit))

        # NOTE: every batch runs to a settled end (no cancellation mid-write), then errors surface.
        await asyncio.gather(*(one(s) for s in range(0, cmap.num_pages, batch)), return_exceptions=True)
        done = await asyncio.gather(*commits, return_exceptions=True)
        errors = failed + [r for r in done if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return ends

    async def _packed_batch(
        self,
        out: Outgoing,
        target: Target,
        chunk: Chunk,
        cmap: ChunkMap,
        start: int,
        batch: int,
        per_page: int,
        chan: OutboundChannel | None = None,
        end: tuple[bool, int] = (False, 0),
    ) -> Coroutine[Any, Any, None]:
        """Reserve (a credit, or a slot by RPC), pack and write one batch; returns its commit
        (which carries ``end`` = the chunk's ``last`` and skipped pages when it ends the chunk)."""
        if chan is not None:
            return await self._credit_batch(out, target, chunk, cmap, start, batch, per_page, chan, end)
        plan = target.plan
        regions = self.e.kv_regions[out.bs.buffer_set_id]
        pool = self.e.pool_for(out.bs)
        peer = self.peers.get(out.peer_address)
        src = cmap.src[start : start + batch]
        nbytes = per_page * src.size
        self.e.sender.check_live(out)
        t_start = time.monotonic()
        resp = await peer.call(
            "ReserveStaging",
            peer_pb2.ReserveStagingRequest(
                transfer_id=out.rec.transfer_id,
                dst_buffer_set_id=plan.dst_buffer_set_id,
                nbytes=nbytes,
                sender_ticket=plan.sender_ticket,
            ),
            self._left(out) + 1.0,
        )
        try:
            dst_view = self.e.local_view(resp.address, nbytes) if peer.is_self else None
            if dst_view is not None and dst_view.device == regions.device:
                # same node, same device: pack straight into the receiver's slot, no wire
                self.e.sender.check_live(out)
                t0 = time.monotonic()
                check = await pack_hashed(plan, target, regions, src, dst_view)
                t1 = t2 = time.monotonic()
            else:
                async with pool.slot(nbytes, out.rec.deadline) as slot:
                    self.e.sender.check_live(out)
                    t0 = time.monotonic()
                    check = await pack_hashed(plan, target, regions, src, pool.view(slot)[:nbytes])
                    t1 = time.monotonic()
                    if dst_view is not None:  # same node, another GPU: one device-to-device copy
                        await asyncio.to_thread(_copy, dst_view, pool.view(slot))
                    else:
                        h = await self._post_write(
                            peer.agent,
                            np.array([[slot.addr, nbytes, pool.device]], dtype=np.int64),
                            np.array([[resp.address, nbytes, resp.device_id]], dtype=np.int64),
                            None,
                            "VRAM" if pool.kind == "vram" else "DRAM",
                            resp.mem_kind or "DRAM",
                        )
                        await self._await(out, h)
                t2 = time.monotonic()
        except BaseException:
            await self._release_remote(out, peer, resp.slot_id, plan.dst_buffer_set_id, plan.sender_ticket)
            raise

        async def commit() -> None:
            await self._commit(
                out,
                target,
                chunk,
                cmap.positions[start : start + batch],
                nbytes,
                end[1],
                1,
                "PACKED",
                resp.slot_id,
                False,
                pack_us=int((t1 - t0) * 1e6),
                wire_us=int((t2 - t1) * 1e6),
                last=end[0],
                check=check,
            )
            _trace_batch(
                out, cmap.positions[start], nbytes, (chunk.queued, t_start, t0, t1, t2, time.monotonic())
            )

        return commit()

    @staticmethod
    def _credit_key(target: Target) -> tuple[str, int]:
        r = target.plan.kv_regions[0]
        return (r.mem_kind or "DRAM", r.device_id if r.mem_kind == "VRAM" else 0)

    async def _credit_batch(
        self,
        out: Outgoing,
        target: Target,
        chunk: Chunk,
        cmap: ChunkMap,
        start: int,
        batch: int,
        per_page: int,
        chan: OutboundChannel,
        end: tuple[bool, int] = (False, 0),
    ) -> Coroutine[Any, Any, None]:
        """Take a credit, pack into our slot, WRITE into the receiver's credit slot; the returned
        coroutine commits on the channel (the credit comes back with the ack)."""
        regions = self.e.kv_regions[out.bs.buffer_set_id]
        pool = self.e.pool_for(out.bs)
        peer = self.peers.get(out.peer_address)
        src = cmap.src[start : start + batch]
        nbytes = per_page * src.size
        key = self._credit_key(target)
        self.e.sender.check_live(out)
        t_acquire = time.monotonic()
        credit, epoch = await chan.acquire(*key, out.rec.deadline)
        try:
            async with pool.slot(nbytes, out.rec.deadline) as slot:
                self.e.sender.check_live(out)
                t0 = time.monotonic()
                check = await pack_hashed(target.plan, target, regions, src, pool.view(slot)[:nbytes])
                t1 = time.monotonic()
                h = await self._post_write(
                    peer.agent,
                    np.array([[slot.addr, nbytes, pool.device]], dtype=np.int64),
                    np.array([[credit.address, nbytes, credit.device_id]], dtype=np.int64),
                    None,
                    "VRAM" if pool.kind == "vram" else "DRAM",
                    "VRAM" if credit.mem_kind == "VRAM" else "DRAM",
                )
                await self._await(out, h)
                t2 = time.monotonic()
        except BaseException:
            chan.give_back(key, credit, epoch)
            raise
        _trace_batch(out, cmap.positions[start], nbytes, (chunk.queued, t_acquire, t0, t1, t2, t2))
        return self._commit(
            out,
            target,
            chunk,
            cmap.positions[start : start + batch],
            nbytes,
            end[1],
            1,
            "PACKED",
            credit.slot_id,
            False,
            pack_us=int((t1 - t0) * 1e6),
            wire_us=int((t2 - t1) * 1e6),
            last=end[0],
            credit=(key, credit, epoch),
            check=check,
        )

    async def _aux(self, out: Outgoing, target: Target, chunk: Chunk) -> tuple[int, int]:
        """Write the aux rows into the receiver's rows; returns (bytes, descriptors)."""
        plan = target.plan
        peer = self.peers.get(out.peer_address)
        local_rows, remote_rows = [], []
        for name, rows in chunk.aux.items():
            if name not in plan.aux_names:
                raise FailedPrecondition(f"aux: receiver has no aux region named {name!r}")
            i = list(plan.aux_names).index(name)
            want = next((np.asarray(a.rows, dtype=np.int64) for a in plan.aux if a.name == name), None)
            if want is None or want.size != rows.size:
                raise FailedPrecondition(
                    f"aux[{name}]: sender names {rows.size} rows, receiver declared "
                    f"{0 if want is None else want.size}"
                )
            mine = out.bs.aux_by_name(name)
            assert mine is not None
            if mine.row_bytes != plan.aux_row_bytes[i]:
                raise FailedPrecondition(
                    f"aux[{name}]: row_bytes {mine.row_bytes} != receiver's {plan.aux_row_bytes[i]}"
                )
            rb = mine.row_bytes
            local_rows.append(
                np.stack([mine.region.address + rows * rb, np.full_like(rows, rb), np.zeros_like(rows)], 1)
            )
            remote_rows.append(
                np.stack(
                    [plan.aux_regions[i].address + want * rb, np.full_like(want, rb), np.zeros_like(want)], 1
                )
            )
        if not local_rows:
            return 0, 0
        nbytes = int(sum(r[:, 1].sum() for r in local_rows))
        ndescs = int(sum(len(r) for r in local_rows))
        if peer.is_self:  # same node: both aux regions are mapped here
            inc = self.e.receiver.get(out.rec.transfer_id, plan.dst_buffer_set_id)
            for name, rows in chunk.aux.items():
                mine, theirs = out.bs.aux_by_name(name), inc.bs.aux_by_name(name)
                assert mine is not None and theirs is not None
                dst_rows = inc.aux[name]
                theirs.region.pages(theirs.row_bytes)[dst_rows] = mine.region.pages(mine.row_bytes)[rows]
            return nbytes, ndescs
        h = await self._post_write(
            peer.agent,
            np.concatenate(local_rows),
            np.concatenate(remote_rows),
            None,
            "DRAM",
            "DRAM",
        )
        await self._await(out, h)
        return nbytes, ndescs

    async def _commit(
        self,
        out: Outgoing,
        target: Target,
        chunk: Chunk,
        positions: np.ndarray,
        nbytes: int,
        skipped: int,
        descs: int,
        path: str,
        slot_id: int,
        aux: bool,
        pack_us: int = 0,
        wire_us: int = 0,
        last: bool = False,
        credit: tuple[tuple[str, int], Any, int] | None = None,
        check: Check | None = None,
    ) -> None:
        trace.mark(out.rec.transfer_id, "commit_start")
        peer = self.peers.get(out.peer_address)
        if peer.is_self:  # same service: account on the receiver directly, no request to build
            inc = self.e.receiver.get(out.rec.transfer_id, target.plan.dst_buffer_set_id)
            sender = f"{self.e.service_id}/{out.bs.layout.tp_rank}"
            if path == "PACKED" and positions.size:
                await self.e.unpack_chunk(
                    inc,
                    sender,
                    slot_id,
                    positions,
                    target.route.dst_head_start,
                    target.route.num_heads,
                    check,
                )
            await self.e.commit(
                inc,
                sender,
                positions,
                last=last,
                nbytes=nbytes,
                skipped=skipped,
                aux=aux,
                primary=target.route.dst_head_start == 0,
                path=path,
                pack_us=pack_us,
                wire_us=wire_us,
                descriptors=descs,
            )
            self.e.table.update(
                out.rec, add_bytes_sent=nbytes, add_descriptors=descs, add_pack=pack_us, add_wire=wire_us
            )
            return
        req = peer_pb2.CommitChunkRequest(
            transfer_id=out.rec.transfer_id,
            dst_buffer_set_id=target.plan.dst_buffer_set_id,
            sender_service_id=self.e.service_id,
            src_tp_rank=out.bs.layout.tp_rank,
            chunk_seq=chunk.seq,
            last_chunk=last,
            path=_PATH_PB[path],
            staging_slot=slot_id,
            positions=positions.tolist(),
            bytes=nbytes,
            pages_skipped=skipped,
            descriptors=descs,
            pack_us=pack_us,
            wire_us=wire_us,
            aux_delivered=aux,
            dst_head_start=target.route.dst_head_start,
            num_heads=target.route.num_heads,
            credit_slot=credit is not None,
            sender_ticket=target.plan.sender_ticket,
            checksum=check[0] if check else 0,
            checksum_kind=check[1] if check else "",
        )
        chan = self._channel(peer)
        trace.mark(out.rec.transfer_id, "commit_sent")
        if chan is None:
            await peer.call("CommitChunk", req, self._left(out) + 1.0)
        else:
            ack = await chan.commit(req, self._left(out) + 1.0, credit)
            trace.mark(out.rec.transfer_id, "ack_got")
            if ack.error_code:
                raise error_from_code(ack.error_code, f"peer {out.peer_address}: {ack.error}")
        self.e.table.update(
            out.rec, add_bytes_sent=nbytes, add_descriptors=descs, add_pack=pack_us, add_wire=wire_us
        )

    async def _post_write(self, peer: str, local: np.ndarray, *rest: Any) -> XferHandle:
        """Post a WRITE of ``local``'s rows: on the loop when posting is cheap (NIXL, a few rows:
        tens of µs, no byte copied; a thread hop costs more), else in a worker thread (a long
        list, or the loopback transport, which copies while it posts)."""
        if self.transport.kind == "nixl" and len(local) <= INLINE_POST_ROWS:
            return self.transport.write_descs(peer, local, *rest)
        return await asyncio.to_thread(self.transport.write_descs, peer, local, *rest)

    async def _await(self, out: Outgoing, h: XferHandle) -> None:
        """Wait for a handle (a poller thread watches it; the loop sleeps); on abort or deadline
        settle it first (no byte lands afterwards)."""
        state = await self.transport.poll_until(h, out.rec.deadline, lambda: bool(out.stop))
        if state == "PROC":
            await self.transport.settle(h)
            self.e.sender.check_live(out)
            raise DeadlineExceeded("transfer deadline passed")
        self.transport.release(h)
        if state == "ERR":
            from ..errors import TransportError

            raise TransportError(f"write to {out.peer_address} failed")

    async def _release_remote(self, out: Outgoing, peer: Any, slot_id: int, dst_bs: str, ticket: str) -> None:
        try:
            await peer.call(
                "CommitChunk",
                peer_pb2.CommitChunkRequest(
                    transfer_id=out.rec.transfer_id,
                    dst_buffer_set_id=dst_bs,
                    sender_service_id=self.e.service_id,
                    src_tp_rank=out.bs.layout.tp_rank,
                    staging_slot=slot_id,
                    release_only=True,
                    sender_ticket=ticket,
                ),
                2.0,
            )
        except Exception:  # the receiver frees the slot with the transfer anyway
            pass

    async def tell_abort(self, out: Outgoing, code: str, reason: str) -> None:
        """Tell the receiver (best effort) that this sender stopped; our handles are settled.
        One abort per receiver rank, each with the ticket its plan gave us (issue 33)."""
        for ticket in sorted({t.plan.sender_ticket for t in out.targets or ()}) or [""]:
            try:
                await self.peers.get(out.peer_address).call(
                    "Abort",
                    peer_pb2.PeerAbortRequest(
                        transfer_id=out.rec.transfer_id,
                        reason=reason,
                        origin_service_id=self.e.service_id,
                        error_code=code,
                        sender_ticket=ticket,
                    ),
                    2.0,
                )
            except Exception as exc:
                log.warning(
                    "could not tell receiver about abort: %s", exc, extra={"transfer_id": out.rec.transfer_id}
                )

    def _left(self, out: Outgoing) -> float:
        left = out.rec.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("transfer deadline passed")
        return left
