"""The landing pool: one arena per memory location, each bounded by ``landing_pool_mb``.

A landing lands where its engine's pool lives, so the Claim is a copy within one device: VRAM of
the engine's GPU for a CUDA buffer set, host memory (pinned when CUDA exists) for a shared-memory
one. Aux rows are host memory (as engines' aux regions are), so a landing's aux rows live in the
host arena::

    shared-memory buffer set   host arena:  [ K0 K1 .. V0 V1 .. | aux rows ]        one range
    CUDA buffer set            vram arena:  [ K0 K1 .. V0 V1 .. ]                   one range
                               host arena:  [ aux rows ]                            (with aux rows)

The host arena is registered with the transport when it is made, so a sender on another node
writes aux rows into it as it writes them into an engine's aux region. Arenas are made at their
location's first landing and kept until the service stops.

Contract: ``take`` returns a :class:`Landing` or None (does not fit); it never exceeds an arena's
capacity and holds nothing when it returns None. ``give`` is idempotent. Event loop only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from ... import kernels
from ...buffers import BufferSet
from ...staging import RangeAllocator
from ._arena import Arena
from .declare import aux_sizes, landing_view, region_sizes

__all__ = ["Landing", "LandingPool", "LandingStats", "Part"]

Register = Callable[[int, int, str, int], None]  # (address, size, mem kind, device)
Needs = list[tuple[Arena, list[int]]]  # per arena, the region sizes of one range there


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


@dataclasses.dataclass(frozen=True)
class Part:
    """One range a landing holds: ``nbytes`` at ``offset`` of ``arena``."""

    arena: Arena
    offset: int
    nbytes: int


@dataclasses.dataclass(eq=False)
class Landing:
    """The memory of one landing: its ranges and the view senders write into."""

    arena: Arena  # where its pages live (the claim copies within this device)
    parts: tuple[Part, ...]  # its ranges: the pages (and aux rows in host memory); a VRAM one's aux rows
    bs: BufferSet  # the landing view (engine layout, ``pages`` pages, regions in the arenas)
    regions: kernels.KVRegions
    freed: bool = False

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def _regions(bs: BufferSet) -> kernels.KVRegions:
    return kernels.KVRegions.of_layout(bs.layout, [r.tensor for r in bs.k], [r.tensor for r in bs.v])


def _fits(trial: RangeAllocator, nbytes: int) -> bool:
    got = trial.alloc(nbytes)
    if got is not None:
        trial.free(got[0])
    return got is not None


class LandingPool:
    def __init__(self, capacity_bytes: int, register: Register | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.arenas: dict[str, Arena] = {}
        self.landings: dict[str, int] = {}  # arena kind -> landings holding bytes there
        self._register = register  # the host arena's transport registration

    @staticmethod
    def device_of(bs: BufferSet) -> torch.device:
        r = bs.k[0]
        return torch.device("cuda", r.device) if r.mem_kind == "VRAM" else torch.device("cpu")

    def arena_for(self, bs: BufferSet) -> Arena:
        """The arena of ``bs``'s memory location (made now if it is the first landing there)."""
        return self._arena(self.device_of(bs))

    def _arena(self, dev: torch.device) -> Arena:
        key = str(dev)
        arena = self.arenas.get(key)
        if arena is None:
            arena = Arena(self.capacity_bytes, dev)
            if dev.type == "cpu" and self._register is not None:
                self._register(arena.buffer.data_ptr(), arena.capacity, "DRAM", 0)
            self.arenas[key] = arena
        return arena

    def needs(self, bs: BufferSet, pages: int, aux: dict[str, np.ndarray]) -> Needs:
        """The ranges a landing of ``pages`` pages and ``aux`` rows takes (making their arenas)."""
        kv, sizes, rows = self.arena_for(bs), region_sizes(bs, pages), aux_sizes(bs, aux)
        if not rows:
            return [(kv, sizes)]
        host = self._arena(torch.device("cpu"))
        return [(kv, sizes + rows)] if host is kv else [(kv, sizes), (host, rows)]

    def take(self, bs: BufferSet, pages: int, aux: dict[str, np.ndarray], needs: Needs) -> Landing | None:
        parts: list[Part] = []
        views: list[torch.Tensor] = []
        for arena, sizes in needs:
            got = arena.take(sizes)
            if got is None:
                for p in parts:  # NOTE: all or nothing
                    p.arena.give(p.offset)
                return None
            parts.append(Part(arena, got[0], Arena.footprint(sizes)))
            views += got[1]
        n = len(bs.regions)
        r = bs.k[0]
        view = landing_view(
            bs, pages, views[:n], r.mem_kind, r.device, dict(zip(aux, views[n:], strict=True))
        )
        for p in parts:
            self.landings[p.arena.kind] = self.landings.get(p.arena.kind, 0) + 1
        return Landing(needs[0][0], tuple(parts), view, _regions(view))

    def give(self, landing: Landing) -> None:
        if landing.freed:
            return
        landing.freed = True
        for p in landing.parts:
            p.arena.give(p.offset)
            self.landings[p.arena.kind] -= 1

    @staticmethod
    def short_of(needs: Needs) -> tuple[Arena, int]:
        """The first arena of ``needs`` that cannot hold its range now, and that range's bytes."""
        for arena, sizes in needs:
            if not _fits(arena.trial(), Arena.footprint(sizes)):
                return arena, Arena.footprint(sizes)
        return needs[0][0], Arena.footprint(needs[0][1])

    @staticmethod
    def victims_needed(needs: Needs, victims: list[Landing]) -> int:
        """How many of ``victims`` (freed in order) must go before ``needs`` fit; -1 when even all
        of them are not enough (fragmentation included: tried on copies, nothing changes)."""
        trials = {arena: arena.trial() for arena, _ in needs}
        for i in range(len(victims) + 1):
            if all(_fits(trials[a], Arena.footprint(sizes)) for a, sizes in needs):
                return i
            if i < len(victims):
                for p in victims[i].parts:
                    if p.arena in trials:
                        trials[p.arena].free(p.offset)
        return -1

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
