"""The values a transfer's routes and its receiver exchange: receive plans, targets, commits, room.

    Plan      where one sender rank's pages go in one receiver rank (the receiver's declaration,
              as the sender sees it: pages, layout, head route, ticket, what it accepts)
    Target    a Plan with what this sender derived from it (units, page order, mapped pools)
    Reserved  room for one packed batch in the receiver's staging (a slot or a channel credit)
    Commit    "these positions landed", from a sender rank to a receiver rank

Protobuf never appears here: peer_codec.py converts at the peer boundary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import torch
from kvservice_client import Layout

from .. import kernels
from ..kernels import KVRegions
from ..kernels._regions import HEAD_MAJOR
from ..kernels.heads import HeadRoute
from .integrity import Check
from .plan import Units

__all__ = ["Commit", "Plan", "Region", "Reserved", "Target"]


class Region(NamedTuple):
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
    offered: bool = False  # pushed unasked (data path v3 §3): commits carry the sender's layout


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
    view: torch.Tensor | None = None
    credit: Any = None


@dataclasses.dataclass(frozen=True)
class Target:
    """A receiver rank this sender writes to (from its receive plan)."""

    plan: Plan
    full_heads: bool
    dst_regions: KVRegions | None = None  # the receiver rank's pools, mapped here (fused route)
    units: Units = Units(1, 1, 1)  # pages of different sizes move as units of their gcd
    head_major: bool = False  # the receiver's page order: staging is packed that way
    converts: bool = False  # page size or page layout differ: kernels only (no DIRECT page copy)

    @classmethod
    def of(cls, plan: Plan, src: Layout, dst_regions: KVRegions | None = None) -> Target:
        dst = plan.dst_layout
        converts = src.page_size != dst.page_size or src.page_layout != dst.page_layout
        full = plan.route.num_heads == src.local_kv_heads == dst.local_kv_heads
        hm = dst.page_layout in HEAD_MAJOR
        return cls(plan, full, dst_regions, Units.of(src, dst), hm, converts)

    @property
    def route(self) -> HeadRoute:
        return self.plan.route

    @property
    def dst_pages(self) -> np.ndarray:
        return self.plan.dst_pages

    def pack(self, regions: KVRegions, src: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """``kernels.pack`` of this route's head slice, in the receiver's unit and page order (its
        unpack is then the straight copy); into ``out`` if given (asynchronous on CUDA)."""
        r = self.route
        return kernels.pack(
            regions,
            src,
            out,
            head_start=r.src_head_start,
            num_heads=r.num_heads,
            unit=self.units.tokens,
            head_major=self.head_major,
        )
