"""From a SendDelta chunk to a route: the receiver's port, the path, the chunk's end.

Sender (sender.py) ─▶ Dispatch.targets: the port of the receiving service (this one, or a peer)
                      and its plans ─▶ Target per receiver rank
                   ─▶ Dispatch.move, per chunk × receiver rank:
                        FUSED   the receiver's pools are mapped here   routes/same_node.py
                        PACKED  staged batches                          routes/packed.py
                        DIRECT  page WRITEs                             routes/direct.py
                      then, unless the route's commit carried it, a marker commit with the
                      chunk's end (skipped pages, aux rows delivered, ``last``)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..buffers import BufferSet
from ..errors import DeadlineExceeded, FailedPrecondition
from .descriptors import choose_path
from .local_receiver import LocalReceiver
from .peer_pools import PeerPools
from .peer_receiver import PeerReceiver
from .plan import ChunkMap
from .port import ReceiverPort
from .routes import RouteContext, commit
from .routes.direct import DirectRoute
from .routes.packed import PackedRoute
from .routes.same_node import SameNodeRoute
from .sender import Chunk, Outgoing
from .values import Commit, Target

if TYPE_CHECKING:
    from .engine import TransferEngine
    from .peer_channel import OutboundChannel

__all__ = ["Dispatch", "path_of"]

log = logging.getLogger(__name__)


def path_of(asked: str, target: Target, registered: bool, where: str) -> str:
    """The path of a chunk to ``target``: what SendDelta ``asked`` for, checked; "AUTO" when the
    choice between DIRECT and PACKED is the calibration's (``registered``: our pool is registered
    with the transport; ``where``: the receiver, for the error message).

        receiver's pools mapped here        FUSED (PACKED if asked: staged on purpose)
        AUTO, full heads, page WRITEs ok    AUTO (descriptors.choose_path decides)
        AUTO otherwise                      PACKED (head slices, conversions, unregistered pools)
    """
    if target.dst_regions is not None:
        return "PACKED" if asked == "PACKED" else "FUSED"
    if asked == "FUSED":
        raise FailedPrecondition(f"path: FUSED needs the receiver's pools mapped here; {where}")
    direct_ok = target.plan.direct_ok and registered and not target.converts
    if asked == "AUTO":
        return "AUTO" if target.full_heads and direct_ok else "PACKED"
    if asked == "DIRECT" and not target.full_heads:
        raise FailedPrecondition("path: DIRECT cannot slice heads (mixed TP); use AUTO or PACKED")
    if asked == "DIRECT" and target.converts:
        raise FailedPrecondition(
            "path: DIRECT copies pages as they are; the receiver's page size or page layout "
            "differs (the kernels convert): use AUTO or PACKED"
        )
    if asked == "DIRECT" and not direct_ok:
        raise FailedPrecondition("path: DIRECT needs both pools registered with the transport; use AUTO")
    return asked


class Dispatch:
    """The sending half of the engine: ports to receivers, and the routes that write to them."""

    def __init__(self, engine: TransferEngine) -> None:
        self._engine = engine  # NOTE: read for its receiver side (LocalReceiver) and config only
        self.peers = engine.peers
        self.transport = engine.transport
        self.no_direct: set[str] = engine.no_direct
        self.peer_pools = PeerPools()
        self.ports: dict[str, PeerReceiver] = {}  # receiving service address -> its port
        self._local: LocalReceiver | None = None
        self._noted: set[tuple[str, str]] = set()  # (peer, reason) of same-host refusals logged
        self.ctx = RouteContext(
            engine.table,
            engine.transport,
            engine.kv_regions,
            engine.local_lists,
            engine.memory.pool_for,
            engine.config.tuning.two_gpu_copy,
        )
        self.fused = SameNodeRoute(self.ctx)
        self.packed = PackedRoute(self.ctx)
        self.direct = DirectRoute(self.ctx)

    # -- ports -----------------------------------------------------------------------------------
    def _local_port(self) -> LocalReceiver:
        if self._local is None:
            self._local = LocalReceiver(self._engine)
        return self._local

    def _port_of(self, out: Outgoing) -> ReceiverPort:
        """The lane's booking (``via_lane``) is of this service's own declaration: its port
        without a handshake (nothing in a booking waits on the network)."""
        return self._local_port() if out.via_lane else self._port(out.peer_address)

    def _port(self, address: str) -> ReceiverPort:
        peer = self.peers.get(address)
        if peer.is_self:
            return self._local_port()
        port = self.ports.get(address)
        if port is None or port.peer is not peer:
            e = self._engine
            port = self.ports[address] = PeerReceiver(
                peer,
                (e.service_id, e.address),
                self.transport,
                self.peer_pools,
                e.config.transfer.same_host_route == "auto",
                self._note,
                lambda address, peer, plan: self._engine.lane.offered(address, peer, plan),
            )
        return port

    @property
    def channels(self) -> dict[str, OutboundChannel]:
        """Open peer channels by address (ops/snapshot reads them)."""
        return {a: p.opened for a, p in self.ports.items() if p.opened is not None}

    async def close(self) -> None:
        for port in self.ports.values():
            await port.close()
        self.ports.clear()
        self.peer_pools.close()

    def _note(self, out: Outgoing, peer_service_id: str, why: str) -> None:
        note = f"same-host fused route not taken ({why}); pages go through the transport"
        self.ctx.table.update(out.rec, route_note=note)
        if (peer_service_id, why) not in self._noted:
            self._noted.add((peer_service_id, why))
            log.warning(note, extra={"peer": out.peer_address, "transfer_id": out.rec.transfer_id})

    # -- the sender's three calls ----------------------------------------------------------------
    async def fetch_targets(self, out: Outgoing) -> list[Target]:
        if not out.via_lane:  # a booking's declaration is this service's own: no handshake
            peer = self.peers.get(out.peer_address)
            left = out.rec.deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded("transfer deadline passed")
            await peer.refresh(timeout=left)
        return await self._port_of(out).targets(out)

    def targets_now(self, out: Outgoing) -> list[Target] | None:
        """Targets known without waiting (a plan the receiver offered), or None: fetch_targets."""
        if out.via_lane:  # a booking's plan comes from this service's own receiver (fetch_targets)
            return None
        peer, port = self.peers.get(out.peer_address), self.ports.get(out.peer_address)
        if port is None or port.peer is not peer or peer.is_self:
            return None
        return port.offered_now(out)

    async def move(self, out: Outgoing, target: Target, chunk: Chunk, cmap: ChunkMap) -> None:
        port = self._port_of(out)
        aux = (0, 0)
        if cmap.num_pages:
            registered = out.bs.buffer_set_id not in self.no_direct
            path = path_of(
                out.path, target, registered, f"{out.peer_address}: {out.rec.route_note or 'another host'}"
            )
            if path == "AUTO":
                path = self._choose(out.bs, cmap.num_pages)
            self.ctx.table.update(out.rec, path=path)
            if path in ("DIRECT", "FUSED"):  # one commit carries the chunk's end too
                aux = await self._write_aux(port, out, target, chunk)
                route = self.direct if path == "DIRECT" else self.fused
                await route.move(port, out, target, chunk, cmap, aux)
                return
            if await self.packed.move(port, out, target, chunk, cmap):
                return  # its one batch's commit carried the chunk's end
        aux = await self._write_aux(port, out, target, chunk)
        if chunk.last or cmap.skipped:  # a marker: skipped pages, the sender's end, aux delivered
            c = Commit(
                cmap.positions[:0],
                "DIRECT",
                target.route.dst_head_start,
                target.route.num_heads,
                nbytes=aux[0],
                skipped=cmap.skipped,
                descriptors=aux[1],
                aux=aux[1] > 0,
                last=chunk.last,
            )
            await commit(self.ctx, port, out, target, chunk.seq, c)

    @staticmethod
    async def _write_aux(port: ReceiverPort, out: Outgoing, target: Target, chunk: Chunk) -> tuple[int, int]:
        """The last chunk's aux rows written to the receiver: (bytes, rows); a chunk the native
        lane copied has them there already (their bytes are in ``chunk.copied``)."""
        if chunk.copied is not None:
            return 0, chunk.copied_aux
        return await port.write_aux(out, target, chunk) if chunk.last and chunk.aux else (0, 0)

    def drop_offer(self, receiver_id: str, transfer_id: str, ticket: str) -> bool:
        """The receiving service ``receiver_id`` ended ``transfer_id`` before any SendDelta of
        ours took its offered plan: forget the offer (a later SendDelta asks, and learns)."""
        dropped = any(
            p.drop_offer(transfer_id, ticket) for p in self.ports.values() if p.peer.service_id == receiver_id
        )
        if dropped:  # nor may an engine here send it on the cross-node lane
            self._engine.lane.drop_out(transfer_id)
        return dropped

    async def tell_abort(self, out: Outgoing, code: str, reason: str) -> None:
        await self._port_of(out).tell_abort(out, code, reason)

    def _choose(self, bs: BufferSet, num_pages: int) -> str:
        descs = len(bs.regions) * num_pages
        total = num_pages * bs.layout.page_bytes_all_layers
        kind = self.transport.kind
        if kind == "nixl":
            kind = f"nixl-{'vram' if bs.memory == 'cuda_ipc' else 'dram'}"
        return choose_path(descs, total, kind, self._engine.calibration).upper()
