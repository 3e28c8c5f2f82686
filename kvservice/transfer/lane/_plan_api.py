"""A receive plan (peer.proto ``ReceivePlan``) as the cross-node lane reads and fills it: the
receiving side puts its slot in an offered plan (``cross_in``), the sending side reads it
(``cross_out``). The lane is domain code and imports no protobuf (tests/test_architecture.py),
so it names the fields it uses; ``peer_pb2.ReceivePlan`` is one. Types only: nothing here runs.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Protocol

__all__ = ["LanePlan", "LaneSlot"]


class LaneSlot(Protocol):
    """``ReceivePlan.lane_slot``: where in the receiver's lane staging the sender WRITEs."""

    agent: str  # the receiving service's lane agent
    address: int
    size_bytes: int
    mem_kind: str  # "DRAM" or "VRAM"
    device_id: int
    signature: int  # cross_slots.geometry_signature of the receiver's pool
    unit_signature: int  # cross_slots.unit_geometry_signature (page-size conversions)
    row_signature: int  # geometry.row_table's (page-layout conversions)


class _Rank(Protocol):
    tp_rank: int
    page_size: int


class LanePlan(Protocol):
    """The fields of a ``ReceivePlan`` the cross-node lane reads (and its slot, which it fills)."""

    transfer_id: str
    dst_layout: _Rank
    dst_buffer_set_id: str
    prefix_pages: int
    dst_page_indices: Sized
    remaining_ms: int
    publishes: bool
    lane_slot: LaneSlot

    def HasField(self, field_name: str, /) -> bool: ...  # (protobuf's name)
