"""The node's host KV tier: whole pages by hash per layout, LRU with leases, filled
write-behind from what the engines publish, served back by LoadPages. See ``base`` for the
contract."""

from __future__ import annotations

from .base import HostTierBase, LayoutKey, Load, Reservation, TierStats
from .calls import Offloaded, TierCalls
from .fill import Filler
from .store import HostTier

__all__ = [
    "Filler",
    "HostTier",
    "HostTierBase",
    "LayoutKey",
    "Load",
    "Offloaded",
    "Reservation",
    "TierCalls",
    "TierStats",
]
