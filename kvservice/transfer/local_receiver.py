"""The receiver port of this very service: the declarations live here, so no request is built.

targets    Receiver.plans (the lane gated first: it may hold the declaration)
mapped     the receiver rank's own KV regions (every same-service chunk is a fused copy,
           unless PACKED was asked for: then it packs straight into the receiver's slot)
reserve    Receiver.reserve ─▶ a slot of our own staging, mapped here
commit     Inbound.accept (PACKED: unpack) or Inbound.account (FUSED: this service copied)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import Aborted, DeadlineExceeded, FailedPrecondition, NotFound
from ..identity import LOCAL_PEER
from .aux_rows import aux_rows
from .receiver import Incoming, plan_of
from .sender import Chunk, Outgoing
from .values import Commit, Plan, Reserved, Target

if TYPE_CHECKING:
    from .engine import TransferEngine

__all__ = ["LocalReceiver"]


class LocalReceiver:
    verifies_copies = False  # this service made the copy: no hop to verify

    def __init__(self, engine: TransferEngine) -> None:
        # NOTE: the engine's receiver side, read only through these names
        self._service_id: str = engine.service_id
        self._address: str = engine.address
        self._receiver = engine.receiver
        self._inbound = engine.inbound
        # NOTE: kvservice.transfer.lane.start replaces engine.lane
        self._lane = lambda tid, lay: engine.lane.gate(tid, lay)
        self._regions_of = engine.regions_of
        self._no_direct: set[str] = engine.no_direct
        self._abort_from_peer = engine.abort_from_peer

    def _key(self, out: Outgoing) -> str:
        return f"{self._service_id}/{out.bs.layout.tp_rank}"

    def _inc(self, out: Outgoing, target: Target) -> Incoming:
        return self._receiver.get(out.rec.transfer_id, target.plan.dst_buffer_set_id)

    async def targets(self, out: Outgoing) -> list[Target]:
        lay, tid = out.bs.layout, out.rec.transfer_id
        if not out.via_lane:  # the native lane may hold it (kvservice.transfer.lane): disarm, or refuse
            await self._lane(tid, lay)
        left = out.rec.deadline - time.monotonic()
        if out.via_lane:  # booking the lane's copy: its declaration is here, late or not; no wait
            left = 0.0
        elif left <= 0:
            raise DeadlineExceeded("transfer deadline passed")
        try:
            found = await self._receiver.plans(tid, lay, self._service_id, self._address, left, LOCAL_PEER)
        except NotFound as exc:
            raise DeadlineExceeded(f"transfer deadline passed: {exc.message}") from None
        if not out.via_lane:  # a declaration armed while we waited
            await self._lane(tid, lay)
        key = self._key(out)
        return [
            Target.of(
                plan_of(inc, route, inc.bs.buffer_set_id not in self._no_direct, key, addresses=False),
                lay,
                self._regions_of(inc),
            )
            for inc, route in found
        ]

    @contextlib.asynccontextmanager
    async def writing(self, out: Outgoing, target: Target) -> AsyncIterator[None]:
        inc = self._inc(out, target)
        if inc.rec.terminal:
            raise Aborted(f"transfer {inc.rec.transfer_id!r} is {inc.rec.state}: {inc.rec.error}")
        inc.enter()  # from here an abort of the receiver waits until the copy ended
        try:
            yield
        finally:
            inc.leave()

    async def batch_pages(self, out: Outgoing, target: Target, per_page: int, pages: int) -> int:
        return pages

    async def reserve(self, out: Outgoing, target: Target, nbytes: int) -> Reserved:
        plan = target.plan
        pool, slot = await self._receiver.reserve(
            out.rec.transfer_id, plan.dst_buffer_set_id, nbytes, LOCAL_PEER, plan.sender_ticket
        )
        return Reserved(slot.serial, slot.addr, pool.device, pool.kind, view=pool.view(slot)[:nbytes])

    async def unreserve(self, out: Outgoing, target: Target, slot: Reserved) -> None:
        inc = self._receiver.incoming.get((out.rec.transfer_id, target.plan.dst_buffer_set_id))
        held = inc.slots.pop(slot.slot_id, None) if inc is not None else None
        if held is not None:
            held[0].release(held[1])

    async def write(
        self, out: Outgoing, local: np.ndarray, remote: np.ndarray, local_kind: str, remote_kind: str
    ) -> None:
        raise FailedPrecondition(
            "path: this service's own pools are copied into, never written over the transport"
        )

    async def remote_pages(self, plan: Plan) -> Any:
        raise FailedPrecondition(
            "path: DIRECT writes go to another service; this service's pools are copied into"
        )

    async def write_aux(self, out: Outgoing, target: Target, chunk: Chunk) -> tuple[int, int]:
        """Both aux regions are mapped here: one row copy per name."""
        local, _ = aux_rows(out.bs, target.plan, chunk.aux)
        inc = self._inc(out, target)
        for name, rows in chunk.aux.items():
            mine, theirs = out.bs.aux_by_name(name), inc.bs.aux_by_name(name)
            assert mine is not None and theirs is not None
            theirs.region.pages(theirs.row_bytes)[inc.aux[name]] = mine.region.pages(mine.row_bytes)[rows]
        return int(local[:, 1].sum()) if local.size else 0, len(local)

    async def commit(
        self, out: Outgoing, target: Target, seq: int, commit: Commit, slot: Reserved | None = None
    ) -> None:
        inc = self._inc(out, target)
        if commit.path == "PACKED":
            await self._inbound.accept(inc, self._key(out), commit)
        else:  # this service made the copy itself: no hop between sender and receiver to verify
            await self._inbound.account(inc, self._key(out), commit)

    async def tell_abort(self, out: Outgoing, code: str, reason: str) -> None:
        """The receiver's declarations belong to other sessions: stop them as a peer abort would,
        one per receiver rank with its ticket."""
        origin = self._service_id
        for ticket in sorted({t.plan.sender_ticket for t in out.targets or ()}) or [""]:
            await self._abort_from_peer(
                out.rec.transfer_id,
                code or "ABORTED",
                f"peer {origin}: {reason}",
                origin,
                LOCAL_PEER,
                ticket,
                senders=False,  # NOTE: the sender is this very call's caller, stopping already
            )
