"""Staging memory owned by the service: pinned host or VRAM pools sliced into slots.

Each pool is one allocation registered with the transport once at creation (``register`` /
``deregister`` callbacks, never per transfer); transfers reserve slots with FIFO
back-pressure (``await pool.reserve(nbytes, deadline)``) and release them, best through
``async with pool.slot(...)``. See ``_pool`` for the full contract.
"""

from __future__ import annotations

from ._allocator import RangeAllocator
from ._pool import MemKind, RegisterFn, Slot, StagingPool, StagingStats

__all__ = ["MemKind", "RangeAllocator", "RegisterFn", "Slot", "StagingPool", "StagingStats"]
