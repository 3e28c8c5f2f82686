"""Python's half of the lane: which pools and transfers the native thread may touch, and the
bookkeeping of what it did.

    RegisterBuffers ─▶ add_pool (regions: address, page stride, page bytes)
    ExpectDelta     ─▶ arm (when eligible: see ``eligible``)      native: ARMED
    engine SEND     ─────────────────────────────────────────────▶ native: RUNNING ─ copy ─ END to
                                                                    both engines ─ COMPLETED
    completion fd   ─▶ finalize: the ordinary same-node SendDelta with its copy already made
                       (records, commit, DONE, index, metrics) ─▶ forget       native: —
    Abort / deadline / failure of the receiver ─▶ settle: disarm, or wait for the finalize
    Abort / deadline / session end of the sender ─▶ the finalize's booking is not stopped: waited for
    any other sender of an armed transfer     ─▶ gate: disarm the ranks it writes, or refuse (the
                                                  lane has its only sender), or wait for the lane's
                                                  copies there (a rank with several senders)
    UnregisterBuffers ─▶ drop_pool (returns once no native copy holds the pool: its memory may
                       then be unmapped; a finalize in flight still books it from ``_retired``)
    engine CALL     ─▶ completion fd ─▶ serve_calls' handler (ExpectDelta, as on the Transfers
                       stream) ─▶ its REPLY on the engine's lane

The rules of DESIGN.md hold: a copy never starts for a transfer that is not ARMED (a disarm is
atomic with the native thread's accept), so no byte lands after Abort returns; an Abort that
meets a running copy waits for it, as the Python route's ``busy`` does.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np
from kvservice_client import lane_wire

from ...errors import FailedPrecondition, KVServiceError
from ...identity import LOCAL_PEER
from ...kernels.heads import plan_heads
from .finalize import Finalizer, booking
from .geometry import head_geometry, heads_overlap, layout_signature, row_table, unit_signature

if TYPE_CHECKING:
    from kvservice_client import Layout

    from ...buffers.registry import BufferSet
    from ...kernels.heads import HeadRoute
    from ..engine import TransferEngine
    from ..peers import PeerClient
    from ..receiver import Incoming
    from ..records import Record
    from ._native_api import NativeLane
    from ._plan_api import LanePlan
    from .cross import CrossBook

__all__ = ["LaneBook", "NoLane"]

log = logging.getLogger(__name__)
# (kind, session id, request id, serialized request) -> the serialized response
CallHandler = Callable[[int, str, str, bytes], Awaitable[bytes]]
_RETIRED = 256  # unregistered buffer sets a finalize in flight may still name (its bookkeeping)


def _routes_into(src: Layout | None, dst: Layout) -> list[HeadRoute] | None:
    """The head routes from sender ranks of layout ``src``'s TP size into the receiver rank of
    layout ``dst`` (None when unknown: no sender layout, or TP sizes that do not split the heads)."""
    if src is None:
        return None
    try:
        routes = plan_heads(src.total_kv_heads, src.tp_size, dst.tp_size)
    except KVServiceError:
        return None
    return [r for r in routes if r.dst_rank == dst.tp_rank]


class NoLane:
    """No native lane (disabled, or it could not be built): every hook does nothing."""

    active = False

    def add_pool(self, bs: BufferSet) -> None:
        pass

    def drop_pool(self, buffer_set_id: str) -> None:
        pass

    def arm(self, inc: Incoming) -> bool:
        return False

    async def settle(self, inc: Incoming, code: str = "", reason: str = "") -> None:
        pass

    async def gate(self, transfer_id: str, src_layout: Layout | None = None) -> None:
        pass

    def drop_session(self, session_id: str) -> None:
        pass

    # the cross-node lane (cross.py)
    def metadata(self) -> bytes:
        return b""

    def load_peer(self, service_id: str, md: bytes) -> str:
        return ""

    def offer_slot(self, inc: Incoming, sender_id: str, identity: str, ticket: str, plan: LanePlan) -> None:
        pass

    def offered(self, address: str, peer: PeerClient, plan: LanePlan) -> None:
        pass

    def gate_out(self, transfer_id: str, rank: int) -> None:
        pass

    def drop_out(self, transfer_id: str) -> None:
        pass

    def gate_in(self, transfer_id: str, buffer_set_id: str) -> None:
        pass

    async def abort_sender(self, session_id: str, transfer_id: str, code: str, reason: str) -> list[Record]:
        """The sending engine's Abort of a transfer only the lane holds (a cross-node stream
        between its chunks): its records once ended (none without a cross-node lane)."""
        return []


class LaneBook(NoLane):
    active = True

    def __init__(self, engine: TransferEngine, native: NativeLane, cuda: bool) -> None:
        self.e = engine
        self.n = native
        self.cuda = cuda
        self.pools: dict[str, BufferSet] = {}  # buffer set id -> BufferSet on the lane
        self._retired: collections.OrderedDict[str, BufferSet] = collections.OrderedDict()
        self._held: list[BufferSet] = []  # buffer sets a native copy still held at drop_pool
        self.cross: CrossBook | None = None  # when the cross-node lane runs
        self.fin = Finalizer(self)  # the completions' bookkeeping
        self._calls: CallHandler | None = None
        self._call_tasks: set[asyncio.Task[None]] = set()

    @property
    def sent(self) -> int:
        """Transfers the lane moved (finalized)."""
        return self.fin.sent

    @property
    def failed(self) -> int:
        return self.fin.failed

    def on_completions(self) -> None:
        """The native thread's completion fd is readable (the loop's reader): its completions
        booked, its CALLs started."""
        self.fin.on_completions()
        if self._calls is not None:
            for call in self.n.take_calls():
                task = asyncio.ensure_future(self._answer(*call))
                self._call_tasks.add(task)
                task.add_done_callback(self._call_tasks.discard)

    # -- calls (lane_wire CALL) ----------------------------------------------------------------
    def serve_calls(self, handler: CallHandler) -> None:
        """Answer the engines' CALLs with ``handler(kind, session, request_id, body)``: the
        serialized response, or it raises a KVServiceError (the REPLY carries its code and
        message). Until this is called every CALL is answered *fallback*."""
        self._calls = handler
        self.n.set_calls(True)

    async def _answer(self, fd: int, session: str, seq: int, kind: int, rid: str, body: bytes) -> None:
        assert self._calls is not None
        try:
            code, msg = lane_wire.ACCEPTED, await self._calls(kind, session, rid, body)
        except KVServiceError as exc:
            code, msg = lane_wire.CALL_ERROR, f"{exc.code.name}\n{exc.message}".encode()
        except Exception:
            log.exception("unhandled error in a lane call", extra={"kind": kind})
            code, msg = lane_wire.CALL_ERROR, b"INTERNAL\nlane call: internal error; see server log"
        self.n.answer(fd, session, seq, code, msg)  # (a connection gone since: nobody to tell)

    def pool(self, buffer_set_id: str) -> BufferSet | None:
        """Buffer set ``buffer_set_id`` on the lane, or recently unregistered (a finalize in
        flight books it), or None."""
        return self.pools.get(buffer_set_id) or self._retired.get(buffer_set_id)

    # -- pools ---------------------------------------------------------------------------------
    def add_pool(self, bs: BufferSet) -> None:
        lay = bs.layout
        regions = bs.regions
        if not regions or lay.num_pages <= 0:
            return
        device = -1 if bs.memory != "cuda_ipc" else int(regions[0].device)
        if device >= 0 and not self.cuda:
            return
        stride = np.array([r.size // lay.num_pages for r in regions], dtype=np.uint64)
        table = np.stack([np.array([r.address for r in regions], dtype=np.uint64), stride, stride], axis=1)
        if device >= 0:
            self.n.prepare_device(device)
        from .cross_slots import geometry_signature, unit_geometry_signature

        self.n.add_pool(
            bs.buffer_set_id,
            bs.session_id,
            device,
            lay.num_pages,
            layout_signature(lay),
            lay.tp_rank,
            table,
            geometry_signature(bs),
        )
        self.n.set_heads(bs.buffer_set_id, *head_geometry(lay))
        self.n.set_units(bs.buffer_set_id, unit_signature(lay), unit_geometry_signature(bs))
        self.n.set_rows(bs.buffer_set_id, *row_table(lay))  # (page-layout conversions)
        # aux regions live in host memory (RegisterBuffers refuses them in VRAM)
        self.n.set_aux(
            bs.buffer_set_id,
            [(a.name, int(a.region.address), int(a.row_bytes), int(a.num_rows)) for a in bs.aux],
        )
        self.pools[bs.buffer_set_id] = bs
        if device >= 0:
            self._map_across(bs, device)

    def _map_across(self, bs: BufferSet, device: int) -> None:
        """Two GPUs: the native copy runs on the sender's GPU, which reaches an imported pool of
        the other GPU only through that pool's mapping in its own context (docs/decisions/0017).
        Map this pool into each other GPU that holds lane pools and theirs into this one; a pair
        that cannot be mapped (no peer path) stays unmapped and the lane refuses it (the
        engine's send falls back to the gRPC route)."""
        from kvservice_client import cuda_ipc

        from ...buffers.memory import alias_addresses

        by_gpu: dict[int, list[BufferSet]] = {}
        for p in self.pools.values():
            if p.memory == "cuda_ipc" and p is not bs:
                by_gpu.setdefault(int(p.regions[0].device), []).append(p)
        by_gpu.pop(device, None)
        for e, theirs in sorted(by_gpu.items()):
            if not (cuda_ipc.enable_peer_access(e, device) and cuda_ipc.enable_peer_access(device, e)):
                continue
            for pool, on in [(bs, e), *((p, device) for p in theirs)]:
                bases = alias_addresses([r.address for r in pool.regions], on)
                if bases is not None:
                    self.n.set_alias(pool.buffer_set_id, on, np.array(bases, dtype=np.uint64))

    def drop_pool(self, buffer_set_id: str) -> None:
        bs = self.pools.pop(buffer_set_id, None)
        if bs is None:
            return
        # NOTE: the native side waits (GIL released) until no copy holds the pool, so its memory
        # may be unmapped once this returns; a wedged device may keep one: its mapping is then
        # kept for the service's life (``_held``) rather than unmapped under it
        if not self.n.drop_pool(buffer_set_id):
            log.error(
                "lane: a copy still holds an unregistered buffer set; its memory stays mapped",
                extra={"buffer_set_id": buffer_set_id},
            )
            self._held.append(bs)
        self._retired[buffer_set_id] = bs
        while len(self._retired) > _RETIRED:
            self._retired.popitem(last=False)

    # -- transfers -----------------------------------------------------------------------------
    def eligible(self, inc: Incoming) -> bool:
        """A declaration the lane may complete: whole pages, or head slices from several sender
        ranks of another TP size (mixed TP) when its pages allow them (``head_geometry``), sent
        in any number of chunks, with aux rows. (Integrity does not exclude it: like the Python
        same-service route, one copy by this service has no hop between sender and receiver to
        verify.)"""
        return (
            inc.bs.buffer_set_id in self.pools
            and inc.landing is None
            and (inc.expected_senders <= 1 or head_geometry(inc.bs.layout)[0] != 0)
            and (not inc.allowed_senders or LOCAL_PEER in inc.allowed_senders)
            and inc.dst_pages.size > 0
        )

    def arm(self, inc: Incoming) -> bool:
        if not self.eligible(inc):
            return False
        self.n.arm(
            inc.rec.transfer_id,
            inc.bs.layout.tp_rank,
            inc.rec.session_id,
            inc.bs.buffer_set_id,
            inc.prefix_pages,
            inc.dst_pages.astype(np.int32),
            inc.rec.deadline,
            inc.expected_senders,  # 0: the layouts say (the lane derives it from the first sender)
            [(name, np.ascontiguousarray(rows, dtype=np.int64)) for name, rows in inc.aux.items()],
        )
        return True

    async def settle(self, inc: Incoming, code: str = "", reason: str = "") -> None:
        """Before the receiver ends otherwise (``code``, ``reason``: how): disarm, or wait until
        the lane's copy is booked. A stream into it waiting for chunks ends, its sender's side
        with that reason."""
        key = (inc.rec.transfer_id, inc.bs.layout.tp_rank)
        if reason:
            self.fin.ended_by_receiver(inc.rec.transfer_id, code, reason)
        if booking(*key):
            return  # the booking itself ends the receiver (a malformed commit): nothing to wait for
        crossing = self.cross is not None and self.cross.rx.settle_in(*key)
        # cancel: a stream into it still waiting for chunks fails (its copies in flight end first)
        if self.n.disarm(*key, cancel=True) == 2 or crossing:
            await self.fin.booked_all(key)

    async def gate(self, transfer_id: str, src_layout: Layout | None = None) -> None:
        """A sender other than the lane wants ``transfer_id``'s plan: disarm the ranks it writes
        to here (``src_layout``: its layout, when known; every rank otherwise). With mixed TP the
        other ranks stay armed: their senders may still take the lane. A rank the lane is moving
        (or has moved) into: refused when this sender is its only one (the lane has the
        transfer); when the rank has several senders, this one waits until the lane's copies
        there are booked, then takes the rank over gRPC (the rank's END then comes that way)."""
        for inc in self.e.receiver.of(transfer_id):
            into = _routes_into(src_layout, inc.bs.layout)
            if into is None:  # unknown routes: where the heads overlap (every rank without a layout)
                if src_layout is not None and not heads_overlap(src_layout, inc.bs.layout):
                    continue
            elif src_layout is not None and not any(r.src_rank == src_layout.tp_rank for r in into):
                continue  # this sender's routes do not reach that rank (replicas: another sender's)
            key = (transfer_id, inc.bs.layout.tp_rank)
            while self.n.disarm(*key) == 2:
                if booking(*key) or (len(into) if into is not None else 1) <= 1:
                    raise FailedPrecondition(
                        f"transfer_id: {transfer_id!r} is being sent by another engine on this node's lane"
                    )
                await self.fin.booked_all(key)

    def drop_session(self, session_id: str) -> None:
        self.n.drop_session(session_id)

    # -- the cross-node lane ---------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self.cross.metadata() if self.cross is not None else b""

    def load_peer(self, service_id: str, md: bytes) -> str:
        return self.cross.load_peer(service_id, md) if self.cross is not None else ""

    def offer_slot(self, inc: Incoming, sender_id: str, identity: str, ticket: str, plan: LanePlan) -> None:
        if self.cross is not None:
            self.cross.rx.offer_slot(inc, sender_id, identity, ticket, plan, self.pools)

    def offered(self, address: str, peer: PeerClient, plan: LanePlan) -> None:
        if self.cross is not None:
            self.cross.tx.offered(address, peer, plan)

    def gate_out(self, transfer_id: str, rank: int) -> None:
        if self.cross is not None:
            self.cross.tx.gate_out(transfer_id, rank)

    def gate_in(self, transfer_id: str, buffer_set_id: str) -> None:
        """A peer moves ``transfer_id`` into ``buffer_set_id`` over gRPC (a plan asked, a slot
        reserved, a commit): that rank's cross-node lane slot goes, or the call is refused while
        the lane moves it. Only that rank: another rank may be on the lane."""
        if self.cross is None:
            return
        for inc in self.e.receiver.of(transfer_id):
            if inc.bs.buffer_set_id == buffer_set_id:
                self.cross.rx.gate_in(transfer_id, inc.bs.layout.tp_rank)

    def drop_out(self, transfer_id: str) -> None:
        """The receiver ended ``transfer_id``: no SEND_TO of it is taken from now on (one already
        writing ends with the receiver's refusal)."""
        if self.cross is not None:
            self.cross.tx.drop_out(transfer_id)

    async def abort_sender(self, session_id: str, transfer_id: str, code: str, reason: str) -> list[Record]:
        if self.cross is None:
            return []
        return await self.cross.tx.abort(session_id, transfer_id, code, reason)
