"""The cross-node lane's receiving side (docs/decisions/0018): a declaration offered to one
sender may carry a slot of this service's lane staging, armed in the native lane; the native
thread's unpack comes back here to be booked (the commit, DONE, the index) and the slot is
freed. A slot whose transfer ended without the lane waits out the deadline (a late WRITE may still
land in it, never in engine pages) before reuse."""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from ...errors import FailedPrecondition, KVServiceError
from .cross_slots import Arena, geometry_signature, slot_bytes, unit_geometry_signature
from .geometry import row_table

if TYPE_CHECKING:
    from ...buffers.registry import BufferSet
    from ..engine import TransferEngine
    from ..receiver import Incoming
    from ._native_api import NativeLane
    from ._plan_api import LanePlan

__all__ = ["CANCELLED", "CrossIn"]

log = logging.getLogger(__name__)
_QUARANTINE_S = 5.0  # past a transfer's deadline before its unused slot is reused
CANCELLED = "cancelled by the receiving service"  # csrc/wire.h: ended here while a chunk unpacked


@dataclasses.dataclass
class _In:
    """A declaration armed on the lane: its slot, and whom it was offered to."""

    arena: Arena
    offset: int
    nbytes: int
    deadline: float
    sender_id: str
    identity: str
    ticket: str


class CrossIn:
    """Slots offered, armed and booked on the receiving side of one service's lane."""

    def __init__(
        self,
        engine: TransferEngine,
        native: NativeLane,
        agent_name: str,
        arenas: dict[int, Arena],
        agents: dict[str, str],
        stream: str,
    ) -> None:
        self.e = engine
        self.n = native
        self.agent_name = agent_name
        self.arenas = arenas
        self._agents = agents  # the book's: peer service id -> its lane agent
        self.stream = stream  # config lane_cross_stream: which larger deltas stream in chunks
        self._in: dict[tuple[str, int], _In] = {}
        self._quarantine: list[tuple[float, int, int, int]] = []  # (free at, device, offset, bytes)
        self.n_received = 0  # transfers booked
        self.n_failed = 0

    def eligible(self, inc: Incoming, lane_pools: dict[str, BufferSet]) -> bool:
        return (
            inc.bs.buffer_set_id in lane_pools
            and inc.landing is None
            and not inc.integrity
            and inc.expected_senders <= 1
            and inc.dst_pages.size > 0
        )

    def offer_slot(
        self,
        inc: Incoming,
        sender_id: str,
        identity: str,
        ticket: str,
        plan: LanePlan,
        pools: dict[str, BufferSet],
    ) -> None:
        """``inc``'s offer to ``sender_id`` may carry a lane slot: take one and arm it."""
        agent = self._agents.get(sender_id)
        if agent is None or not self.eligible(inc, pools):
            return
        self._release_quarantined()
        bs = inc.bs
        device = int(bs.regions[0].device) if bs.memory == "cuda_ipc" else -1
        arena = self.arenas.get(device)
        if arena is None:
            return
        page = sum(r.size // bs.layout.num_pages for r in bs.regions)
        streams = self.stream == "all" or (self.stream == "gpu" and device >= 0)
        nbytes = slot_bytes(int(inc.dst_pages.size), page, arena.slots.size, streams)
        off = arena.slots.take(nbytes) if nbytes else None
        if off is None:
            return  # staging full (or smaller than two pages): this one goes over gRPC
        key = (inc.rec.transfer_id, bs.layout.tp_rank)
        self._in[key] = _In(arena, off, nbytes, inc.rec.deadline, sender_id, identity, ticket)
        self.n.arm_in(
            inc.rec.transfer_id,
            bs.layout.tp_rank,
            inc.rec.session_id,
            bs.buffer_set_id,
            agent,
            inc.prefix_pages,
            inc.dst_pages.astype(np.int32),
            arena.base + off,
            nbytes,
            device,
            inc.rec.deadline,
            [(name, np.ascontiguousarray(rows, dtype=np.int64)) for name, rows in inc.aux.items()],
        )
        s = plan.lane_slot
        s.agent, s.address, s.size_bytes = self.agent_name, arena.base + off, nbytes
        s.mem_kind, s.device_id = ("VRAM", device) if device >= 0 else ("DRAM", 0)
        s.signature = geometry_signature(bs)
        s.unit_signature = unit_geometry_signature(bs)
        s.row_signature = row_table(bs.layout)[0]

    def gate_in(self, transfer_id: str, rank: int) -> None:
        """A gRPC commit or slot request for ``transfer_id``: the lane gives it up, or refuses
        when it is moving (or moved) it."""
        if (transfer_id, rank) not in self._in:
            return
        if self.n.disarm_in(transfer_id, rank) == 2:
            raise FailedPrecondition(f"transfer_id: {transfer_id!r} is being received on the cross-node lane")
        self._retire(transfer_id, rank)

    def settle_in(self, transfer_id: str, rank: int) -> bool:
        """The receiver ends otherwise: True when the lane is moving (or moved) it (wait for its
        completion); else its slot goes to quarantine."""
        if (transfer_id, rank) not in self._in:
            return False
        if self.n.disarm_in(transfer_id, rank, cancel=True) == 2:
            return True  # a streamed one stops after the chunk being unpacked (CANCELLED)
        self._retire(transfer_id, rank)
        return False

    def _retire(self, transfer_id: str, rank: int) -> None:
        """An armed slot left unused: the sender may still WRITE into it until the deadline."""
        x = self._in.pop((transfer_id, rank))
        at = max(x.deadline, time.monotonic()) + _QUARANTINE_S
        heapq.heappush(self._quarantine, (at, x.arena.device, x.offset, x.nbytes))

    def _release_quarantined(self) -> None:
        now = time.monotonic()
        while self._quarantine and self._quarantine[0][0] <= now:
            _, device, off, nbytes = heapq.heappop(self._quarantine)
            self.arenas[device].slots.give(off, nbytes)

    async def received(
        self, tid: str, rank: int, ok: bool, error: str, nbytes: int, copy_us: int, told: bool, first: int = 0
    ) -> None:
        """The native thread unpacked (or failed to) a transfer into the declared pages (``first``:
        the transfer page the sender's first sent page was; those below the prefix were skipped)."""
        e = self.e
        x = self._in.get((tid, rank))
        if x is not None and ok:
            self._in.pop((tid, rank))
            x.arena.slots.give(x.offset, x.nbytes)
        elif x is not None:  # a failed WRITE may still be landing: quarantined like an unused slot
            self._retire(tid, rank)
        self.n.forget_in(tid, rank)
        inc = next((i for i in e.receiver.of(tid) if i.bs.layout.tp_rank == rank), None)
        if inc is None or x is None or error == CANCELLED:
            return  # cancelled: whoever ended it (Abort, the deadline) books that end
        inc.rec.lane_told = told
        inc.rec.route_note = "cross-node lane"
        if not ok:
            self.n_failed += 1
            await e.fail_incoming(inc, KVServiceError(f"cross-node lane: {error}"))
            return
        from ..values import Commit

        lay = inc.bs.layout
        n = int(inc.dst_pages.size)
        positions = np.arange(inc.prefix_pages, inc.prefix_pages + n, dtype=np.int64)
        c = Commit(
            positions,
            "FUSED",
            0,
            lay.local_kv_heads,
            nbytes=nbytes,
            skipped=max(0, int(inc.prefix_pages) - first),
            descriptors=1,
            aux=bool(inc.aux),  # (the lane fails a transfer whose declared aux rows never came)
            last=True,
            wire_us=copy_us,
        )
        src_layout = dataclasses.replace(lay, tp_rank=rank)  # the lane pairs equal ranks (one layout)
        try:
            await e.inbound.apply(
                tid, inc.bs.buffer_set_id, x.sender_id, rank, x.ticket, x.identity, c, None, src_layout
            )
            self.n_received += 1
        except KVServiceError as exc:
            log.warning(
                "cross-node lane: booking a received transfer failed: %s", exc, extra={"transfer_id": tid}
            )

    def close(self) -> None:
        self._in.clear()
