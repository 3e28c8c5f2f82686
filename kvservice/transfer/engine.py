"""The transfer engine: ExpectDelta / SendDelta / Poll / WatchTransfers / Abort and the KVPeer side.

Owns the transport (one agent per service), the staging pools, the transfer table, the
receiver and sender halves, and the per-buffer-set transport state made at registration
(memory registered once, one prepped descriptor list per buffer set). A reaper enforces
deadlines (NIXL has none). Every method runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from .. import kernels
from ..buffers import BufferRegistry, BufferSet
from ..config import Config
from ..errors import NotFound, ResourceExhausted
from ..index import PrefixIndex
from ..kernels import completions
from ..notices import SessionNotices
from .dispatch import Dispatch
from .duplicates import DuplicateBook
from .ends import Ends
from .inbound import Inbound
from .lane.book import LaneBook, NoLane
from .load import Budget, LoadBook
from .memory import TransportMemory
from .peer_channel import CreditBroker, OfferChannels
from .peer_names import PeerNames
from .peer_serving import offer_plan
from .peers import PeerDirectory, Self
from .receiver import Incoming, Receiver
from .records import Record, TransferTable
from .sender import Chunk, Outgoing, Sender
from .transport import Transport

__all__ = ["TransferEngine", "make_transport"]


log = logging.getLogger(__name__)


def make_transport(kind: str, name: str, progress_delay_us: int) -> Transport:
    if kind == "loopback":
        from .loopback import LoopbackTransport

        return LoopbackTransport(name)
    from .nixl_transport import NixlTransport

    return NixlTransport(name, progress_delay_us=progress_delay_us)


class TransferEngine:
    """The transfers of one service (see the module docstring), reached by peers at ``address``.

    Collaborators, built before it (``node.NodeParts``): ``buffers`` (followed through its hooks:
    memory registered with the transport, pools with the lane), ``index`` (pages a DONE transfer
    delivered, duplicate marks, lease expiry), ``notices`` (duplicate counts told to sessions).
    """

    def __init__(
        self,
        config: Config,
        service_id: str,
        address: str,
        buffers: BufferRegistry,
        index: PrefixIndex,
        notices: SessionNotices,
    ) -> None:
        cfg = config
        self.config = cfg
        self.service_id = service_id
        self.address = address
        self.buffers = buffers
        self.index = index
        self.notices = notices
        self.transport = make_transport(
            cfg.transfer.transport, f"kvs-{service_id}", cfg.transfer.nixl_progress_delay_us
        )
        self.calibration = None  # per-kind defaults in descriptors.CALIBRATIONS
        self.metadata_epoch = 0
        self.table = TransferTable(cfg.transfer.transfer_retain_s)
        self.load = LoadBook(
            self.table,
            Budget(cfg.limits.inbound_max_transfers, cfg.limits.inbound_max_bytes),
            self._staging_waiters,
        )
        self.peers = PeerDirectory(
            Self(self.service_id, "0.1.0", address, self.transport, lambda: self.metadata_epoch),
            cfg.listen.keepalive,
            cfg.security.peer_security,
        )
        self.memory = TransportMemory(cfg, self.transport, self._epoch_moved)
        self.kv_regions = self.memory.kv_regions  # NOTE: the same dicts and set, read by the routes
        self.local_lists = self.memory.local_lists
        self.no_direct = self.memory.no_direct
        self.receiver = Receiver(self.table, self.memory.pool_for)
        self.inbound = Inbound(
            self.table,
            self.receiver,
            self.regions_of,
            self.no_direct,
            lambda inc, exc: self.ends.fail_incoming(inc, exc),
            index,
        )
        self.dispatch = Dispatch(self)
        self.credit_broker = CreditBroker()  # receiver side of the peer channels
        self.inbound_channels: set[asyncio.Task[Any]] = set()  # their handler tasks (grpc's)
        self.offer_channels = OfferChannels()  # ... by sending service address (plans pushed)
        self.sender = Sender(
            self.table, self.dispatch, cfg.transfer.workers_per_peer, cfg.transfer.peer_inflight_mb
        )
        self.duplicates = DuplicateBook(self)
        from .landing import LandingBook  # NOTE: the landing pool's receivers use this engine

        self.landing = LandingBook(self)
        self.peer_names = PeerNames(cfg, address)
        self.ends = Ends(
            self.service_id,
            self.table,
            self.sender,
            self.receiver,
            self.dispatch,
            lambda: self.lane,
            self.landing,
            index,
        )
        # the ways a transfer ends early, as the server, the lane and the landing book call them
        self.abort = self.ends.abort
        self.abort_from_peer = self.ends.abort_from_peer
        self.fail_incoming = self.ends.fail_incoming
        self.sender_gone = self.ends.sender_gone
        self.abort_buffer_set = self.ends.abort_buffer_set
        self.release_session = self.ends.release_session
        self.abort_all = self.ends.abort_all
        self.lane: NoLane = NoLane()  # attach_lane replaces it when the lane runs
        buffers.add_hooks(self._on_register, self._on_unregister)

    def start(self) -> None:
        self.ends.start()
        self.duplicates.start()

    # -- the native lane: it comes up after the engine (a first build takes ~20 s) -------------
    def expect_lane(self, starting: asyncio.Future[Any]) -> None:
        """The lane is starting: handshakes wait (a bounded time) for it to carry its agent."""
        self.peers.me.lane_starting = starting

    def attach_lane(self, book: LaneBook) -> None:
        """Same-node copies (and, with its cross-node half, handshakes' agent) go through ``book``."""
        for bs in self.buffers.all():
            book.add_pool(bs)
        self.lane = book
        if book.cross is not None:
            self.peers.me.lane = book
            # handshakes made before this point carried no lane metadata either way: our peers see a
            # new epoch in our plans and handshake again; our own clients do at their next use
            self.metadata_epoch += 1
            self.peers.stale()

    def detach_lane(self) -> None:
        self.lane = NoLane()
        self.peers.me.lane = None

    # -- memory --------------------------------------------------------------------------------
    def _epoch_moved(self) -> None:
        self.metadata_epoch += 1

    def _on_register(self, bs: BufferSet) -> None:
        self.memory.register(bs)
        try:
            self.lane.add_pool(bs)
        except BaseException:
            self.memory.unregister(bs)
            raise

    def _staging_waiters(self, buffer_set_id: str) -> int:
        """Reservations waiting in the staging pool ``buffer_set_id``'s packed chunks use."""
        try:
            bs = self.buffers.get(buffer_set_id)
        except NotFound:
            return 0
        return self.memory.waiters(bs)

    def _on_unregister(self, bs: BufferSet) -> None:
        self.lane.drop_pool(bs.buffer_set_id)  # returns once no lane copy uses its pages
        self.load.drop(bs.buffer_set_id)
        self.duplicates.drop_buffer_set(bs.buffer_set_id)
        self.memory.unregister(bs)

    # -- engine API ----------------------------------------------------------------------------
    def _check_transfer_cap(self, session_id: str) -> None:
        cap = self.config.limits.max_transfers_per_session
        if self.table.live_per_session.get(session_id, 0) >= cap:
            raise ResourceExhausted(
                f"max_transfers_per_session: this session already has {cap} unfinished transfers"
            )

    async def expect(self, inc: Incoming, sender_address: str = "") -> Record:
        self._check_transfer_cap(inc.rec.session_id)
        inc.integrity = self.config.transfer.transfer_integrity
        if sender_address and not inc.allowed_senders:  # no first-fetcher race (docs/design/security.md)
            inc.allowed_senders = await self.peer_names.allowed(sender_address)
        # NOTE: no await between admission and the record's add in receiver.expect: one step.
        self.load.admit(inc.bs.buffer_set_id, inc.rec.expected_bytes)
        await self.receiver.expect(inc)
        own = sender_address == self.address
        chan = None if own else self.offer_channels.get(sender_address, inc.allowed_senders)
        # the sender's channel is open: its plan goes now, unasked (data path v3 §3); else an
        # engine on this node may send it over the native lane
        if chan is None or not await offer_plan(self, inc, chan):
            self.lane.arm(inc)
        return inc.rec

    async def send(self, out: Outgoing, chunk: Chunk) -> Record:
        new = self.table.get(out.rec.key) is None
        if new and not out.via_lane:  # the lane's booking of a copy already made is never refused
            self._check_transfer_cap(out.rec.session_id)
            self.lane.gate_out(out.rec.transfer_id, out.bs.layout.tp_rank)  # over gRPC: not on the lane
        self.sender.add(out)
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

    def regions_of(self, inc: Incoming) -> kernels.KVRegions:
        """The KV regions ``inc``'s pages live in: the engine's, or a landing pool's."""
        return inc.regions if inc.regions is not None else self.kv_regions[inc.bs.buffer_set_id]

    def in_flight(self) -> int:
        return self.table.in_flight()

    async def close(self, settled: Callable[[Awaitable[Any], str], Awaitable[None]] | None = None) -> None:
        """Abort what is left (through ``settled``: the node's shutdown bound) and release it all."""
        self.ends.stop()
        await self.duplicates.close()
        aborting = self.abort_all("service shutting down")
        await (settled(aborting, "aborting transfers at close") if settled is not None else aborting)
        completions.shutdown()
        await self.dispatch.close()
        for task in list(self.inbound_channels):
            task.cancel()
        await self.peers.close()
        self.memory.close()
        self.transport.close()
