"""The transfer engine: ExpectDelta / SendDelta / Poll / WatchTransfers / Abort and the KVPeer side.

Owns the transport (one agent per service), the staging pools, the transfer table, the
receiver and sender halves, and the per-buffer-set transport state made at registration
(memory registered once, one prepped descriptor list per buffer set). A reaper enforces
deadlines (NIXL has none). Every method runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np

from .. import kernels
from ..buffers import BufferSet
from ..errors import Aborted, FailedPrecondition, InvalidArgument, KVServiceError, NotFound, ResourceExhausted
from ..kernels import checksum, completions
from ..kernels.streams import on_side_stream, run_on_device
from ..lane.book import NoLane
from ..staging import StagingPool
from . import trace
from .descriptors import prepped_rows
from .duplicates import DuplicateBook
from .integrity import Check, landed_check, unpack_verified
from .load import Budget, LoadBook
from .mover import Mover
from .parties import may_abort_in, may_abort_out
from .peer_channel import CreditBroker
from .peer_names import PeerNames
from .peers import PeerDirectory, Self
from .receiver import Incoming, Receiver
from .records import Record, TransferTable
from .sender import Outgoing, Sender
from .transport import RegHandle, Transport

__all__ = ["TransferEngine", "make_transport"]


def _warm_kernels(bs: BufferSet) -> None:
    """Compile the Triton pack/unpack specialisations this pool needs, on scratch memory.

    NOTE: never on the engine's pages (the service writes only pages a call names); the first
    transfer would otherwise pay seconds of JIT compilation. Runs on the pool's own device.
    """
    import torch

    lay = bs.layout
    dev = bs.k[0].tensor.device

    def warm() -> None:
        k = [torch.zeros(2 * lay.region_bytes_k // lay.num_pages, dtype=torch.uint8, device=dev)]
        v = [torch.zeros(2 * lay.page_bytes_v, dtype=torch.uint8, device=dev)] if lay.num_v_regions else None
        regions = kernels.KVRegions.of_layout(lay, k, v)
        idx = np.array([1], dtype=np.int64)
        for heads in sorted({lay.local_kv_heads, max(1, lay.local_kv_heads // 2)}):
            staged = kernels.pack(regions, idx, num_heads=heads)
            kernels.unpack(regions, staged, idx, num_heads=heads)
            # transfer_integrity: the sender's checksum, the receiver's verdict (a 64-bit expected
            # value: Triton compiles 32- and 64-bit integer arguments apart) and its gated unpack
            checksum.launch(staged, "wsum64")
            verdict = checksum.launch(staged, "wsum64", expect=1 << 62)
            kernels.unpack(regions, staged, idx, num_heads=heads, gate=verdict.gate)

    on_side_stream(dev, warm)


log = logging.getLogger(__name__)


def make_transport(kind: str, name: str, progress_delay_us: int) -> Transport:
    if kind == "loopback":
        from .loopback import LoopbackTransport

        return LoopbackTransport(name)
    from .nixl_transport import NixlTransport

    return NixlTransport(name, progress_delay_us=progress_delay_us)


class TransferEngine:
    def __init__(self, node: Any, address: str) -> None:
        cfg = node.config
        self.node = node
        self.config = cfg
        self.service_id = node.service_id
        self.address = address
        self.transport = make_transport(cfg.transport, f"kvs-{node.service_id}", cfg.nixl_progress_delay_us)
        self.calibration = None  # per-kind defaults in descriptors.CALIBRATIONS
        self.metadata_epoch = 0
        self.table = TransferTable(cfg.transfer_retain_s)
        self.load = LoadBook(
            self.table, Budget(cfg.inbound_max_transfers, cfg.inbound_max_bytes), self._staging_waiters
        )
        self.peers = PeerDirectory(
            Self(self.service_id, "0.1.0", address, self.transport, lambda: self.metadata_epoch),
            cfg.keepalive,
            cfg.peer_security,
        )
        self._pool_regs: dict[int, RegHandle] = {}
        self.host_pool = StagingPool(
            cfg.host_staging_mb << 20, "host", register=self._reg_pool, deregister=self._dereg_pool
        )
        self.vram_pools: dict[int, StagingPool] = {}
        self.local_lists: dict[str, Any] = {}
        self.kv_regions: dict[str, kernels.KVRegions] = {}
        self._regs: dict[str, list[RegHandle]] = {}
        self.no_direct: set[str] = set()  # buffer sets the transport could not register (packed only)
        self.receiver = Receiver(self.table, self.pool_for)
        self.mover = Mover(self)
        self.credit_broker = CreditBroker()  # receiver side of the peer channels
        self.inbound_channels: set[asyncio.Task[Any]] = set()  # their handler tasks
        self.sender = Sender(self.table, self.mover, cfg.workers_per_peer, cfg.peer_inflight_mb)
        self.duplicates = DuplicateBook(self)
        from ..landing import LandingBook  # NOTE: the landing pool's receivers use this engine

        self.landing = LandingBook(self)
        self.peer_names = PeerNames(cfg, address)
        self._reaper: asyncio.Task[None] | None = None
        self._reaping: set[tuple[str, str, str]] = set()
        self._fused_warm: threading.Thread | None = None
        self.lane: NoLane = NoLane()  # kvservice.lane.start replaces it when the lane runs
        node.buffers.add_hooks(self._on_register, self._on_unregister)

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="transfer-reaper")
        self.duplicates.start()

    # -- memory --------------------------------------------------------------------------------
    def _reg_pool(self, addr: int, size: int, kind: str, dev: int) -> None:
        self._pool_regs[addr] = self.transport.register(addr, size, kind, dev)  # type: ignore[arg-type]
        self.metadata_epoch += 1

    def _dereg_pool(self, addr: int, size: int, kind: str, dev: int) -> None:
        reg = self._pool_regs.pop(addr, None)
        if reg is not None:
            self.transport.deregister(reg)

    def _pools(self) -> list[StagingPool]:
        return [self.host_pool, *self.vram_pools.values()]

    def pool_for(self, bs: BufferSet) -> StagingPool:
        if bs.memory != "cuda_ipc":
            return self.host_pool
        dev = bs.k[0].device
        pool = self.vram_pools.get(dev)
        if pool is None:
            pool = self.vram_pools[dev] = StagingPool(
                self.config.vram_staging_mb << 20,
                "vram",
                device=dev,
                register=self._reg_pool,
                deregister=self._dereg_pool,
            )
        return pool

    def _on_register(self, bs: BufferSet) -> None:
        regs: list[RegHandle] = []
        try:
            for r in tuple(a.region for a in bs.aux):
                regs.append(self.transport.register(r.address, r.size, r.mem_kind, r.device))  # type: ignore[arg-type]
            if bs.memory == "cuda_ipc":
                # NOTE: UCX refuses memory this process imported through CUDA IPC (NIXL_ERR_BACKEND,
                # seen on H100 + NIXL 1.5.1), and a failed registration left the agent's metadata
                # unloadable by peers. Such pools move through the packed path only: our kernels
                # read/write them and the staging pools, which we allocate, are registered.
                self.no_direct.add(bs.buffer_set_id)
                self.pool_for(bs)  # create (and register) the VRAM staging pool before peers look
                _warm_kernels(bs)
            else:
                regs.extend(self._register_kv(bs))
                self._warm_fused_cpu()
            self.kv_regions[bs.buffer_set_id] = kernels.KVRegions.of_layout(
                bs.layout, [r.tensor for r in bs.k], [r.tensor for r in bs.v]
            )
            self.lane.add_pool(bs)
        except BaseException:
            lst = self.local_lists.pop(bs.buffer_set_id, None)
            if lst is not None:
                self.transport.release_list(lst)
            for reg in regs:
                self.transport.deregister(reg)
            raise
        self._regs[bs.buffer_set_id] = regs
        self.metadata_epoch += 1

    def _warm_fused_cpu(self) -> None:
        """Compile the CPU fused copy in the background at the first host buffer set."""
        if self._fused_warm is None:
            from ..kernels import _fused_cpu

            self._fused_warm = threading.Thread(target=_fused_cpu.warm, name="warm-fused-copy", daemon=True)
            self._fused_warm.start()

    def _register_kv(self, bs: BufferSet) -> list[RegHandle]:
        regs: list[RegHandle] = []
        try:
            for r in bs.regions:
                regs.append(self.transport.register(r.address, r.size, r.mem_kind, r.device))  # type: ignore[arg-type]
            lay = bs.layout
            pb = np.array([r.size // lay.num_pages for r in bs.regions], dtype=np.int64)
            rows = prepped_rows(
                np.array([r.address for r in bs.regions], dtype=np.int64), pb, lay.num_pages, bs.k[0].device
            )
            self.local_lists[bs.buffer_set_id] = self.transport.prep_local(rows, bs.k[0].mem_kind)  # type: ignore[arg-type]
        except BaseException:
            for reg in regs:
                self.transport.deregister(reg)
            raise
        return regs

    def _staging_waiters(self, buffer_set_id: str) -> int:
        """Reservations waiting in the staging pool ``buffer_set_id``'s packed chunks use."""
        try:
            bs = self.node.buffers.get(buffer_set_id)
        except NotFound:
            return 0
        # NOTE: a lookup, not pool_for: the metrics thread calls this and must never create a pool
        pool = self.host_pool if bs.memory != "cuda_ipc" else self.vram_pools.get(bs.k[0].device)
        return pool.stats().waiters if pool is not None else 0

    def _on_unregister(self, bs: BufferSet) -> None:
        self.lane.drop_pool(bs.buffer_set_id)  # returns once no lane copy uses its pages
        self.load.drop(bs.buffer_set_id)
        self.duplicates.drop_buffer_set(bs.buffer_set_id)
        self.no_direct.discard(bs.buffer_set_id)
        self.kv_regions.pop(bs.buffer_set_id, None)
        lst = self.local_lists.pop(bs.buffer_set_id, None)
        if lst is not None:
            self.transport.release_list(lst)
        for reg in self._regs.pop(bs.buffer_set_id, []):
            self.transport.deregister(reg)

    # -- engine API ----------------------------------------------------------------------------
    def _check_transfer_cap(self, session_id: str) -> None:
        cap = self.config.max_transfers_per_session
        if self.table.live_per_session.get(session_id, 0) >= cap:
            raise ResourceExhausted(
                f"max_transfers_per_session: this session already has {cap} unfinished transfers"
            )

    async def expect(self, inc: Incoming, sender_address: str = "") -> Record:
        self._check_transfer_cap(inc.rec.session_id)
        inc.integrity = self.config.transfer_integrity
        if sender_address and not inc.allowed_senders:  # no first-fetcher race (issue 33)
            inc.allowed_senders = await self.peer_names.allowed(sender_address)
        # NOTE: no await between admission and the record's add in receiver.expect: one step.
        self.load.admit(inc.bs.buffer_set_id, inc.rec.expected_bytes)
        await self.receiver.expect(inc)
        self.lane.arm(inc)  # an engine on this node may now send it over the native lane
        return inc.rec

    async def send(self, out: Outgoing, chunk: Any) -> Record:
        new = self.table.get(out.rec.key) is None
        if new and not out.via_lane:  # the lane's booking of a copy already made is never refused
            self._check_transfer_cap(out.rec.session_id)
        self.sender.outgoing[(out.rec.transfer_id, out.bs.buffer_set_id)] = out
        if new:
            self.table.add(out.rec)
        self.sender.enqueue(out, chunk)
        return out.rec

    def records(self, session_id: str, transfer_ids: Iterable[str]) -> list[Record]:
        ids = set(transfer_ids)
        if ids:
            return [r.snapshot() for t in ids for r in self.table.find(t) if r.session_id == session_id]
        return [
            r.snapshot()
            for r in self.table.select(
                lambda r: r.session_id == session_id and (not ids or r.transfer_id in ids)
            )
        ]

    def watch(
        self, session_id: str, transfer_ids: Iterable[str], include_current: bool
    ) -> AsyncIterator[Record]:
        ids = set(transfer_ids)
        return self.table.watch(
            lambda r: r.session_id == session_id and (not ids or r.transfer_id in ids), include_current
        )

    async def abort(
        self,
        session_id: str | None,
        transfer_id: str,
        code: str,
        reason: str,
        notify: bool = True,
    ) -> list[Record]:
        """Stop every side of ``transfer_id`` (of ``session_id`` if given); settled on return.
        (A peer's abort goes through :meth:`abort_from_peer`.)"""
        if not transfer_id:
            raise InvalidArgument("transfer_id", "is required")
        outs = [
            o
            for (t, _), o in self.sender.outgoing.items()
            if t == transfer_id and (session_id is None or o.rec.session_id == session_id)
        ]
        incs = [
            i for i in self.receiver.of(transfer_id) if session_id is None or i.rec.session_id == session_id
        ]
        if session_id is not None and not outs and not incs:
            raise NotFound(f"transfer_id: no transfer {transfer_id!r} of this client on this service")
        await asyncio.gather(
            *(
                self._abort_out(o, code, reason, notify and bool(self.peers.get(o.peer_address).service_id))
                for o in outs
            ),
            *(self._abort_in(i, code, reason, notify) for i in incs),
        )
        return [o.rec.snapshot() for o in outs] + [i.rec.snapshot() for i in incs]

    async def abort_from_peer(
        self, transfer_id: str, code: str, reason: str, origin: str, identity: str, ticket: str = ""
    ) -> bool:
        """A peer's Abort: only the sides of ``transfer_id`` that peer is a party to stop (see
        :func:`parties.may_abort_in` / :func:`parties.may_abort_out`). Returns whether any side stopped."""
        outs = [
            o
            for (t, _), o in self.sender.outgoing.items()
            if t == transfer_id
            and self.peers.get(o.peer_address).service_id == origin
            and may_abort_out(o, identity, ticket)
        ]
        incs = [i for i in self.receiver.of(transfer_id) if may_abort_in(i, origin, identity, ticket)]
        await asyncio.gather(
            *(self._abort_out(o, code, reason, False) for o in outs),
            *(self._abort_in(i, code, reason, True, origin) for i in incs),
        )
        return bool(outs or incs)

    async def _abort_out(self, out: Outgoing, code: str, reason: str, notify: bool) -> None:
        self.sender.stop(out, code, reason)
        await self.sender.stopped(out)
        state = "ABORTED" if code == "ABORTED" else "FAILED"
        if self.table.finish(out.rec, state, code, reason) and notify:
            await self.mover.tell_abort(out, code, reason)

    async def _abort_in(self, inc: Incoming, code: str, reason: str, notify: bool, origin: str = "") -> None:
        await self.lane.settle(inc)  # disarmed, or the lane's copy is booked (then this is DONE)
        state = "ABORTED" if code == "ABORTED" else "FAILED"
        landed = inc.rec.state == "LANDED"  # its senders are done: nobody to tell
        if not self.table.finish(inc.rec, state, code, reason):
            return
        if notify and not landed:  # senders settle their in-flight writes before they answer
            await asyncio.gather(
                *(
                    self._tell(inc.senders[key.rpartition("/")[0]], inc.rec.transfer_id, code, reason, ticket)
                    for key, ticket in inc.tickets.items()
                    if key.rpartition("/")[0] != origin and key.rpartition("/")[0] in inc.senders
                )
            )
        while inc.busy:  # an unpack in progress finishes first
            await asyncio.sleep(0.001)
        self.receiver.release_slots(inc)
        if inc.landing is not None:  # its landing-pool bytes are free when the abort returns
            self.landing.release(inc.landing)

    async def _tell(self, address: str, transfer_id: str, code: str, reason: str, ticket: str = "") -> None:
        from kvservice_client._proto import peer_pb2

        try:
            await self.peers.get(address).call(
                "Abort",
                peer_pb2.PeerAbortRequest(
                    transfer_id=transfer_id,
                    reason=reason,
                    origin_service_id=self.service_id,
                    error_code=code,
                    sender_ticket=ticket,
                ),
                5.0,
            )
        except Exception as exc:
            log.warning(
                "abort not acknowledged by sender %s: %s", address, exc, extra={"transfer_id": transfer_id}
            )

    async def unpack_chunk(
        self,
        inc: Incoming,
        sender: str,
        slot_id: int,
        positions: np.ndarray,
        head_start: int,
        num_heads: int,
        check: Check | None = None,
    ) -> None:
        """Scatter a packed chunk of ``sender`` (its key) from its staging slot into the engine's
        pages, then free the slot."""
        held = inc.slots.pop(slot_id, None)
        if held is None:
            raise NotFound(f"staging_slot: {slot_id} is not reserved for this transfer")
        await self._unpack_guarded(
            inc, sender, held, positions, head_start, num_heads, release=True, check=check
        )

    async def _unpack_guarded(
        self,
        inc: Incoming,
        sender: str,
        held: Any,
        positions: np.ndarray,
        head_start: int,
        num_heads: int,
        release: bool,
        check: Check | None = None,
    ) -> None:
        try:
            await self._unpack_held(inc, sender, held, positions, head_start, num_heads, release, check)
        except (Aborted, NotFound):
            raise
        except KVServiceError as exc:  # a bad unpack fails the transfer on both sides
            await self.fail_incoming(inc, exc)
            raise

    async def _unpack_held(
        self,
        inc: Incoming,
        sender: str,
        held: Any,
        positions: np.ndarray,
        head_start: int,
        num_heads: int,
        release: bool,
        check: Check | None = None,
    ) -> None:
        pool, slot = held
        regions = self.regions_of(inc)
        units = inc.units.get(sender)
        if units is None:
            raise FailedPrecondition(f"sender {sender} committed without fetching the plan")
        dst = units.land(positions, inc.prefix_pages, inc.dst_pages)
        nbytes = kernels.packed_nbytes(regions, int(dst.size), num_heads, unit=units.tokens)
        inc.busy += 1
        t0 = time.monotonic()
        try:
            if inc.rec.terminal:
                raise Aborted(f"transfer {inc.rec.transfer_id!r} is {inc.rec.state}: {inc.rec.error}")
            view = pool.view(slot)
            if nbytes > view.numel():  # NOTE: DONE means bytes arrived: no slot, no data (issue 33)
                raise FailedPrecondition(
                    f"positions: {positions.size} positions need {nbytes} bytes; staging slot "
                    f"{slot.serial} holds {view.numel()}"
                )
            view = view[:nbytes]
            kw: dict[str, Any] = {"head_start": head_start, "num_heads": num_heads, "unit": units.tokens}
            if inc.integrity:  # verified before a byte is unpacked: the unpack is gated on the verdict
                what = f"packed batch at position {int(positions[0])}"
                await unpack_verified(regions, view, dst, check, what, **kw)
            else:
                await run_on_device(view.device, "unpack", lambda: kernels.unpack(regions, view, dst, **kw))
        finally:
            inc.busy -= 1
            if release:
                pool.release(slot)
        t1 = time.monotonic()
        self.table.update(inc.rec, add_unpack=int((t1 - t0) * 1e6))
        if log.isEnabledFor(logging.DEBUG):  # the receiver's half of a batch timeline (monotonic s)
            log.debug(
                "unpacked batch",
                extra={"transfer_id": inc.rec.transfer_id, "first": int(positions[0]), "t": [t0, t1]},
            )

    async def apply_commit(
        self, req: Any, credit_slots: dict[int, tuple[StagingPool, Any]] | None = None, *, identity: str
    ) -> str:
        """A sender's CommitChunk (unary or on its channel): unpack a packed batch, account it.
        Only a sender that fetched this transfer's plan, over a connection of the same peer
        ``identity``, may commit (or release) into it."""
        trace.mark(req.transfer_id, "commit_got")
        inc = self.receiver.get(req.transfer_id, req.dst_buffer_set_id)
        sender = f"{req.sender_service_id}/{req.src_tp_rank}"
        self.receiver.check_sender(inc, req.sender_service_id, identity, sender, req.sender_ticket)
        if req.release_only:
            held = inc.slots.pop(req.staging_slot, None)
            if held is not None:
                held[0].release(held[1])
            return inc.rec.state
        positions = np.asarray(req.positions, dtype=np.int64)
        path = {1: "DIRECT", 2: "PACKED", 3: "FUSED"}.get(req.path, "DIRECT")
        check = (req.checksum, req.checksum_kind) if req.checksum_kind else None
        if path == "PACKED" and positions.size:
            if req.credit_slot:
                held = (credit_slots or {}).get(req.staging_slot)
                if held is None:
                    raise NotFound(f"staging_slot: {req.staging_slot} is not a credit of this channel")
                await self._unpack_guarded(
                    inc,
                    sender,
                    held,
                    positions,
                    req.dst_head_start,
                    req.num_heads,
                    release=False,
                    check=check,
                )
            else:
                await self.unpack_chunk(
                    inc, sender, req.staging_slot, positions, req.dst_head_start, req.num_heads, check
                )
        elif positions.size:
            await self._check_landed(inc, sender, path, positions, req.dst_head_start, req.num_heads, check)
        return await self.commit(
            inc,
            sender,
            positions,
            last=req.last_chunk,
            nbytes=req.bytes,
            skipped=req.pages_skipped,
            aux=req.aux_delivered,
            primary=req.dst_head_start == 0,
            path=path,
            pack_us=req.pack_us,
            wire_us=req.wire_us,
            descriptors=req.descriptors,
        )

    async def _check_landed(
        self,
        inc: Incoming,
        sender: str,
        path: str,
        positions: np.ndarray,
        head_start: int,
        num_heads: int,
        check: Check | None,
    ) -> None:
        """DONE means the bytes arrived (issue 33): a DIRECT commit into pages the transport could
        not have written fails the transfer; with integrity, the pages a DIRECT or FUSED commit
        names must hash to the sender's checksum (packed for this rank, as a staging batch)."""
        try:
            if path == "DIRECT" and inc.bs.buffer_set_id in self.no_direct:
                raise FailedPrecondition(
                    f"path: a DIRECT commit of {positions.size} positions, but this buffer set takes no "
                    "direct writes: no data reached them"
                )
            if inc.integrity:
                units = inc.units.get(sender)
                if units is None:
                    raise FailedPrecondition(f"sender {sender} committed without fetching the plan")
                dst = units.land(positions, inc.prefix_pages, inc.dst_pages)
                await landed_check(
                    self.regions_of(inc),
                    dst,
                    check,
                    f"{path.lower()} chunk at position {int(positions[0])}",
                    head_start=head_start,
                    num_heads=num_heads,
                    unit=units.tokens,
                )
        except KVServiceError as exc:
            await self.fail_incoming(inc, exc)
            raise

    async def receive_plans(self, request: Any, peer: str, identity: str) -> Any:
        """GetReceivePlan (unary or on a channel; ``peer`` is the caller's gRPC peer string,
        ``identity`` what it proved, see kvservice.identity): wait for the declarations this
        sender rank writes to, then say where its pages go — with the receiver's pool handles for
        a same-host sender on a local connection."""
        from kvservice_client import Layout
        from kvservice_client._proto import peer_pb2

        from .. import host
        from .receiver import plan_message

        src = Layout.from_proto(request.src_layout)
        wait = min(request.wait_ms / 1000, self.config.max_deadline_ms / 1000)
        self.lane.gate(request.transfer_id)  # a peer sends it: the native lane may not
        found = await self.receiver.plans(
            request.transfer_id, src, request.sender_service_id, request.sender_address, wait, identity
        )
        self.lane.gate(request.transfer_id)
        out = peer_pb2.ReceivePlanSet(metadata_epoch=self.metadata_epoch)
        same_host = bool(request.sender_boot_id) and request.sender_boot_id == host.boot_id()
        refusal = ""
        if same_host and self.config.same_host_route != "auto":
            refusal = "the receiver's same_host_route is 'off'"
        elif same_host and not host.is_local_peer(peer):
            refusal = f"the plan was asked over {peer}, not a Unix socket or loopback"
        key = f"{request.sender_service_id}/{src.tp_rank}"
        for inc, route in found:
            plan = plan_message(inc, route, inc.bs.buffer_set_id not in self.no_direct, sender_key=key)
            why = refusal or (
                "the receiver lands it in its landing pool" if same_host and inc.landing else ""
            )
            if same_host and not why:
                plan.kv_handles.extend(r.origin for r in (*inc.bs.k, *inc.bs.v))
            plan.same_host_refusal = why
            out.plans.append(plan)
        trace.mark(request.transfer_id, "plan_served")
        return out

    async def sender_gone(self, sender_service_id: str, why: str) -> None:
        """A sending service's channel ended: its live incoming transfers fail now (UNAVAILABLE)."""
        for inc in list(self.receiver.incoming.values()):
            if not inc.rec.terminal and inc.rec.state != "LANDED" and sender_service_id in inc.senders:
                await self._abort_in(inc, "UNAVAILABLE", f"sender {sender_service_id}: {why}", notify=False)

    def regions_of(self, inc: Incoming) -> kernels.KVRegions:
        """The KV regions ``inc``'s pages live in: the engine's, or a landing's (kvservice.landing)."""
        return inc.regions if inc.regions is not None else self.kv_regions[inc.bs.buffer_set_id]

    def pool_of(self, mem_kind: str, device: int) -> StagingPool:
        """The staging pool a receiver uses for buffer sets in ``mem_kind`` memory (on ``device``)."""
        if mem_kind != "VRAM":
            return self.host_pool
        pool = self.vram_pools.get(device)
        if pool is None:
            raise NotFound(f"mem_kind: no VRAM staging pool on device {device} (no CUDA buffer set there)")
        return pool

    async def commit(
        self,
        inc: Incoming,
        sender_key: str,
        positions: np.ndarray,
        *,
        last: bool,
        nbytes: int,
        skipped: int,
        aux: bool,
        primary: bool,
        path: str,
        pack_us: int = 0,
        wire_us: int = 0,
        descriptors: int = 0,
    ) -> str:
        """Account a chunk that landed in ``inc``'s pages; DONE (and publish) when it was the last.

        A malformed commit fails the transfer (and raises); returns the receiver's state.
        """
        try:
            self.table.update(
                inc.rec,
                add_pack=pack_us,
                add_wire=wire_us,
                add_descriptors=descriptors,
                **({"path": path} if positions.size else {}),
            )
            self.receiver.record_chunk(inc, sender_key, positions, last, nbytes, skipped, aux, primary)
        except (Aborted, NotFound):
            raise
        except KVServiceError as exc:
            await self.fail_incoming(inc, exc)
            raise
        if self.receiver.complete_if_done(inc):
            self.publish_received(inc)
        return inc.rec.state

    async def fail_incoming(self, inc: Incoming, exc: Any) -> None:
        await self._abort_in(inc, exc.code.name, exc.message, True)

    def publish_received(self, inc: Incoming) -> None:
        """After DONE: insert the sequence's pages into the index when the receiver asked to."""
        index = self.node.index
        if inc.publish_hashes is None or index is None:
            return
        pages = np.concatenate([inc.prefix_page_indices, inc.dst_pages])
        try:
            index.publish(inc.bs.buffer_set_id, inc.publish_hashes, pages, 0, tokens=inc.publish_tokens)
        except Exception:
            log.exception("publishing received pages failed", extra={"transfer_id": inc.rec.transfer_id})

    async def abort_buffer_set(self, bs_id: str) -> int:
        recs = [r for r in self.table.live() if r.buffer_set_id == bs_id]
        for tid in {r.transfer_id for r in recs}:
            await self.abort(None, tid, "ABORTED", f"buffer set {bs_id} unregistered")
        return len(recs)

    async def release_session(self, session_id: str) -> None:
        recs = [r for r in self.table.live() if r.session_id == session_id]
        for tid in {r.transfer_id for r in recs}:
            await self.abort(session_id, tid, "ABORTED", "the owning client went away")

    def local_view(self, addr: int, nbytes: int) -> Any:
        """The bytes ``[addr, addr+nbytes)`` of one of our staging pools (same-node transfers)."""
        for pool in self._pools():
            base = pool.buffer.data_ptr()
            if base <= addr and addr + nbytes <= base + pool.capacity_bytes:
                return pool.buffer[addr - base : addr - base + nbytes]
        raise NotFound(f"staging address {addr:#x} is not in this service's pools")

    def staging_stats(self) -> list[Any]:
        return [pool.stats() for pool in self._pools()]

    def in_flight(self) -> int:
        return self.table.in_flight()

    async def abort_all(self, reason: str) -> None:
        for tid in {r.transfer_id for r in self.table.live()}:
            await self.abort(None, tid, "ABORTED", reason)

    async def _reap(self) -> None:
        """Every 10 ms: fail live transfers past their deadline; every second: prune and expire."""
        tick = 0
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            for rec in self.table.live():
                if rec.deadline < now and rec.key not in self._reaping:
                    self._reaping.add(rec.key)
                    asyncio.ensure_future(self._expire(rec))
            tick += 1
            if tick % 100 == 0:
                for key in self.table.prune():
                    self._forget(key)
                self.node.index.expire_leases()
                self.mover.peer_pools.expire()

    async def _expire(self, rec: Record) -> None:
        key = (rec.transfer_id, rec.buffer_set_id)
        why = "transfer deadline passed"
        try:
            if rec.role == "SENDER" and key in self.sender.outgoing:
                await self._abort_out(self.sender.outgoing[key], "DEADLINE_EXCEEDED", why, True)
            elif rec.role == "RECEIVER" and key in self.receiver.incoming:
                await self._abort_in(self.receiver.incoming[key], "DEADLINE_EXCEEDED", why, True)
            else:
                self.table.finish(rec, "FAILED", "DEADLINE_EXCEEDED", why)
        finally:
            self._reaping.discard(rec.key)

    def _forget(self, key: tuple[str, str, str]) -> None:
        tid, _, bs_id = key
        out = self.sender.outgoing.get((tid, bs_id))
        if out is not None and out.rec.key == key and out.rec.terminal:
            del self.sender.outgoing[(tid, bs_id)]
        inc = self.receiver.incoming.get((tid, bs_id))
        if inc is not None and inc.rec.key == key and inc.rec.terminal:
            self.receiver.forget((tid, bs_id))

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await self.duplicates.close()
        await self.abort_all("service shutting down")
        completions.shutdown()
        await self.mover.close_channels()
        for task in list(self.inbound_channels):
            task.cancel()
        await self.peers.close()
        self.mover.peer_pools.close()
        for pool in self._pools():
            pool.close()
        self.transport.close()
