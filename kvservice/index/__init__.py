"""Prefix index of the KV pages on this node (DESIGN.md "Prefix index"); contract in ``base``."""

from __future__ import annotations

from .base import BufferSetSpec, EvictableLeaf, IndexStats, Lease, Match, PrefixIndexBase
from .prefix_index import PrefixIndex, as_hashes

__all__ = [
    "BufferSetSpec",
    "EvictableLeaf",
    "IndexStats",
    "Lease",
    "Match",
    "PrefixIndex",
    "PrefixIndexBase",
    "as_hashes",
]
