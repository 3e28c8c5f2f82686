"""The landing pool: one arena per memory location, each bounded by ``landing_pool_mb``.

A landing lands where its engine's pool lives, so the Claim is a copy within one device: VRAM of
the engine's GPU for a CUDA buffer set, host memory (pinned when CUDA exists) for a shared-memory
one. Arenas are made at their location's first landing and kept until the service stops.

Contract: ``take`` returns a :class:`Landing` or None (does not fit); it never exceeds the arena's
capacity. ``give`` is idempotent. Event loop only.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import kernels
from ..buffers import BufferSet
from ._arena import Arena
from .declare import landing_view, region_sizes

__all__ = ["Landing", "LandingPool", "LandingStats"]


@dataclasses.dataclass(frozen=True)
class LandingStats:
    """A snapshot of one arena and the landing counters of its location."""

    location: str
    capacity_bytes: int
    used_bytes: int
    peak_bytes: int
    landings: int
    claims: int = 0
    expired: int = 0
    evicted: int = 0
    refused: int = 0


@dataclasses.dataclass(eq=False)
class Landing:
    """The memory of one landing: its range in ``arena`` and the view senders write into."""

    arena: Arena
    offset: int
    nbytes: int
    bs: BufferSet  # the landing view (engine layout, ``pages`` pages, regions in the arena)
    regions: kernels.KVRegions
    freed: bool = False


def _regions(bs: BufferSet) -> kernels.KVRegions:
    return kernels.KVRegions.of_layout(bs.layout, [r.tensor for r in bs.k], [r.tensor for r in bs.v])


class LandingPool:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.arenas: dict[str, Arena] = {}
        self.landings: dict[str, int] = {}  # arena kind -> landings holding bytes there

    @staticmethod
    def device_of(bs: BufferSet) -> torch.device:
        r = bs.k[0]
        return torch.device("cuda", r.device) if r.mem_kind == "VRAM" else torch.device("cpu")

    def arena_for(self, bs: BufferSet) -> Arena:
        """The arena of ``bs``'s memory location (made now if it is the first landing there)."""
        dev = self.device_of(bs)
        key = str(dev)
        arena = self.arenas.get(key)
        if arena is None:
            arena = self.arenas[key] = Arena(self.capacity_bytes, dev)
        return arena

    def take(self, bs: BufferSet, pages: int, arena: Arena) -> Landing | None:
        sizes = region_sizes(bs, pages)
        got = arena.take(sizes)
        if got is None:
            return None
        offset, views = got
        r = bs.k[0]
        view = landing_view(bs, pages, views, r.mem_kind, r.device)
        self.landings[arena.kind] = self.landings.get(arena.kind, 0) + 1
        return Landing(arena, offset, Arena.footprint(sizes), view, _regions(view))

    def give(self, landing: Landing) -> None:
        if landing.freed:
            return
        landing.freed = True
        landing.arena.give(landing.offset)
        self.landings[landing.arena.kind] -= 1

    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self.arenas.values())

    def stats(self, counts: dict[str, dict[str, int]]) -> list[LandingStats]:
        """One entry per arena, with ``counts[kind]`` (claims, expired, evicted, refused)."""
        return [
            LandingStats(
                a.kind,
                a.capacity,
                a.used_bytes,
                a.peak_bytes,
                self.landings.get(a.kind, 0),
                **counts.get(a.kind, {}),
            )
            for a in list(self.arenas.values())  # NOTE: the metrics thread reads this too
        ]
