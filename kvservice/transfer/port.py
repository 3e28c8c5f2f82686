"""The receiver as a route sees it (data path v3 §6): plans, staging, aux rows, commits, aborts.

    SendDelta chunk ─▶ Dispatch.move (dispatch.py: picks the route)
                        │
                        ├─ routes/same_node.py  one fused copy into the receiver's mapped pools
                        ├─ routes/packed.py     pack ─▶ staging ─▶ WRITE (or none) ─▶ unpack there
                        └─ routes/direct.py     page WRITEs straight into the receiver's pages
                        │
                        ▼  every route talks to one ReceiverPort, never to "is it us?"
          LocalReceiver (local_receiver.py)   this service: Inbound directly, no protobuf
          PeerReceiver  (peer_receiver.py)    another service: its channel / KVPeer calls
                        │
                        ▼
          Inbound.accept (inbound.py): unpack a packed batch, account, DONE + publish after the last

The values here are the domain's: protobuf stays at the peer boundary (peer_codec.py).
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from kvservice_client import Layout

from ..kernels.heads import HeadRoute
from .integrity import Check

if TYPE_CHECKING:
    from .sender import Chunk, Outgoing, Target

__all__ = ["Commit", "Plan", "ReceiverPort", "Region", "Reserved"]


@dataclasses.dataclass(frozen=True)
class Region:
    """A receiver memory region as a sender addresses it."""

    address: int
    size: int
    mem_kind: str  # "DRAM" | "VRAM"
    device: int


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Where one sender rank's pages go in one receiver rank (a ReceivePlan, as the domain sees it).

    ``dst_pages[i]`` receives delta page ``prefix_pages + i`` of the sequence; ``route`` is the head
    slice this sender rank writes there; ``sender_ticket`` is the secret its commits must carry.
    """

    transfer_id: str
    dst_buffer_set_id: str
    dst_layout: Layout
    prefix_pages: int
    dst_pages: np.ndarray
    route: HeadRoute
    sender_ticket: str = ""
    integrity: bool = False  # commits must carry a checksum of their bytes
    direct_ok: bool = False  # the receiver's pages take page WRITEs (registered with the transport)
    publishes: bool = False  # the receiver inserts the pages into its index at DONE
    expected_senders: int = 0
    remaining_ms: int = 0
    aux: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # name -> receiver rows
    kv_regions: tuple[Region, ...] = ()
    aux_regions: tuple[Region, ...] = ()
    aux_row_bytes: tuple[int, ...] = ()
    aux_names: tuple[str, ...] = ()
    kv_handles: tuple[Any, ...] = ()  # the receiver's pool handles, for a same-host sender
    same_host_refusal: str = ""  # why no handles came (same host, but the route is not allowed)


@dataclasses.dataclass(frozen=True)
class Commit:
    """ "These positions landed": what a sender rank tells a receiver rank after a route moved bytes.

    ``positions`` are sequence positions in the sender's units (plan.py); a PACKED commit's bytes
    wait in the receiver's staging slot ``slot_id`` (a channel credit when ``credit``) and are
    unpacked into heads ``[head_start, +num_heads)``. ``last`` ends this sender rank's transfer
    (``skipped``: the sender's prefix pages it did not send); ``aux``: the aux rows are written.
    ``check``: the checksum of the bytes, when the plan asked for integrity.
    """

    positions: np.ndarray
    path: str  # "DIRECT" | "PACKED" | "FUSED"
    head_start: int
    num_heads: int
    nbytes: int = 0
    skipped: int = 0
    descriptors: int = 0
    slot_id: int = 0
    credit: bool = False
    aux: bool = False
    last: bool = False
    pack_us: int = 0
    wire_us: int = 0
    check: Check | None = None

    @property
    def primary(self) -> bool:
        """The sender writing the rank's first head: its pages count (mixed TP, p > d)."""
        return self.head_start == 0


@dataclasses.dataclass(eq=False)
class Reserved:
    """Room for one packed batch in the receiver's staging.

    ``view``: the slot's bytes when they are mapped here (same service: pack or copy straight
    into it, no WRITE); else ``address``/``device``/``mem_kind`` name it for a WRITE.
    ``credit``: a channel credit (comes back with the commit's ack), not a reserved slot.
    """

    slot_id: int
    address: int
    device: int
    mem_kind: str
    view: Any = None
    credit: Any = None


class ReceiverPort(Protocol):
    """One receiving service, as the routes of one sending service see it.

    Every method runs on the event loop and raises the kvservice error tree (NotFound: no such
    declaration; Aborted: the receiver ended it; DeadlineExceeded; Unavailable).
    """

    verifies_copies: bool  # a fused copy's commit carries a checksum (the receiver is another service)

    async def targets(self, out: Outgoing) -> list[Target]:
        """The receiver ranks ``out`` writes to, waiting (within its deadline) for their
        declarations; binds this sender rank to each (one ticket per rank)."""
        ...

    def writing(self, out: Outgoing, target: Target) -> AbstractAsyncContextManager[None]:
        """Held while a route writes into the receiver's mapped pools: refuses once the receiver
        ended, and an abort of the receiver returns only after the block left."""
        ...

    async def batch_pages(self, out: Outgoing, target: Target, per_page: int, pages: int) -> int:
        """How many pages of ``per_page`` packed bytes one staging batch may carry."""
        ...

    async def reserve(self, out: Outgoing, target: Target, nbytes: int) -> Reserved:
        """Room for ``nbytes`` of packed pages in the receiver's staging (a credit when it can)."""
        ...

    async def unreserve(self, out: Outgoing, target: Target, slot: Reserved) -> None:
        """Give back room no commit will use (a batch that failed before its commit)."""
        ...

    async def write(
        self, out: Outgoing, local: np.ndarray, remote: np.ndarray, local_kind: str, remote_kind: str
    ) -> None:
        """WRITE descriptor rows ``[addr, bytes, device]`` of ours into the receiver's memory;
        returns once they landed (on ``out``'s stop or deadline: settled, then raises)."""
        ...

    async def remote_pages(self, plan: Plan) -> Any:
        """The transport's prepped descriptor list of the plan's pages (DIRECT writes)."""
        ...

    async def write_aux(self, out: Outgoing, target: Target, chunk: Chunk) -> tuple[int, int]:
        """Write the chunk's aux rows into the rows the receiver declared; (bytes, descriptors)."""
        ...

    async def commit(
        self, out: Outgoing, target: Target, seq: int, commit: Commit, slot: Reserved | None = None
    ) -> None:
        """Tell the receiver rank the commit's positions landed (a PACKED batch: in ``slot``);
        returns once it accepted them (the batch is unpacked by then; a credit is back).
        Raises what the receiver refused."""
        ...

    async def tell_abort(self, out: Outgoing, code: str, reason: str) -> None:
        """Best effort: this sender stopped (its writes are settled)."""
        ...
