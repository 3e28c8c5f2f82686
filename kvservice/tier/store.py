"""``HostTier``: the arenas of every layout, their leases and counters (see ``base`` for the
contract). Memory comes from ``_memory.host_pages``: pinned when CUDA is present."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from ..errors import FailedPrecondition, InvalidArgument, PermissionDenied
from ..index.prefix_index import as_hashes
from ._memory import host_pages
from ._slots import HELD, Slots
from .base import HostTierBase, LayoutKey, Load, Reservation, TierListener, TierStats

__all__ = ["HostTier"]

log = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int64)


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Arena:
    """One layout's pages: ``pages[slot]`` is a whole page of ``page_bytes``."""

    def __init__(self, key: LayoutKey, page_bytes: int, capacity: int) -> None:
        self.key = key
        self.page_bytes = page_bytes
        self.memory = host_pages(capacity, page_bytes)  # keeps the allocation alive
        self.pages: np.ndarray = self.memory.numpy()
        self.slots = Slots(capacity)
        self.load_pins = np.zeros(capacity, dtype=np.int32)


@dataclasses.dataclass
class _Lease:
    owner: str
    expires_unix_ms: int
    parts: list[tuple[LayoutKey, np.ndarray]]  # (arena, pinned slots)


class HostTier(HostTierBase):
    """``capacity_bytes`` split evenly over at most ``max_layouts`` arenas, each made on its
    layout's first store; 0 bytes: disabled."""

    def __init__(
        self, capacity_bytes: int, max_layouts: int = 2, clock_ms: Callable[[], int] = _now_ms
    ) -> None:
        self.capacity_bytes = max(int(capacity_bytes), 0)
        self.max_layouts = max(int(max_layouts), 1)
        self._clock = clock_ms
        self._lock = threading.RLock()
        self._arenas: dict[LayoutKey, _Arena] = {}
        self._refused: set[LayoutKey] = set()
        self._leases: dict[str, _Lease] = {}
        self._tick = 0
        self.hits = self.misses = self.evictions = 0
        self.stored_pages = self.stored_bytes = self.duplicate_pages = self.loaded_pages = 0
        self.backlog: Callable[[], int] = lambda: 0  # the filler's queue length (pages)
        self.listeners: list[TierListener] = []  # told of pages stored and evicted (KV events)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _arena(self, key: LayoutKey, page_bytes: int | None = None) -> _Arena | None:
        """The arena of ``key``; with ``page_bytes``, made on first use if room is left."""
        arena = self._arenas.get(key)
        if arena is not None:
            if page_bytes is not None and page_bytes != arena.page_bytes:
                raise InvalidArgument(
                    "page_bytes",
                    f"layout {key.describe()} has {arena.page_bytes}-byte pages, got {page_bytes}",
                )
            return arena
        if page_bytes is None or not self.enabled or key in self._refused:
            return None
        if page_bytes <= 0:
            raise InvalidArgument("page_bytes", f"must be > 0, got {page_bytes}")
        capacity = self.capacity_bytes // self.max_layouts // page_bytes
        if len(self._arenas) >= self.max_layouts or capacity == 0:
            self._refused.add(key)
            log.warning(
                "host tier: no arena for this layout (host_tier_layouts arenas exist, or a page is "
                "larger than an arena)",
                extra={"layout": key.describe(), "arenas": len(self._arenas)},
            )
            return None
        arena = self._arenas[key] = _Arena(key, page_bytes, capacity)
        log.info(
            "host tier arena", extra={"layout": key.describe(), "pages": capacity, "page_bytes": page_bytes}
        )
        return arena

    # -- storing ---------------------------------------------------------------------------

    def reserve(self, key: LayoutKey, page_bytes: int, hashes: np.ndarray) -> Reservation:
        h = as_hashes(hashes, "hashes")
        with self._lock:
            arena = self._arena(key, page_bytes)
            if arena is None:
                return Reservation(key, h[:0], _EMPTY, _EMPTY, 0, int(h.size), 0)
            self._expire(self._clock())
            s = arena.slots
            # NOTE: a hash twice in one request is stored once (its first position)
            _, first = np.unique(h, return_index=True)
            first.sort()
            found = s.find(h[first])
            dup = (found >= 0) | s.filling(h[first])
            if dup.any():  # a page published again is a use: it moves up the LRU order
                s.tick[found[found >= 0]] = self._next_tick()
            want = first[~dup]
            duplicates = int(h.size - want.size)
            evicted = 0
            short = int(want.size) - s.nfree
            if short > 0:
                victims = s.victims(short)
                gone = s.H[victims]  # fancy indexing copies: read before give_back
                s.give_back(victims)
                for listener in self.listeners:
                    listener.tier_removed(key, gone)
                evicted = int(victims.size)
                self.evictions += evicted
            n = min(int(want.size), s.nfree)
            slots = s.take(n)
            s.H[slots] = h[want[:n]]
            self.duplicate_pages += duplicates
            return Reservation(
                key,
                h[want[:n]].copy(),
                slots,
                want[:n].astype(np.int64),
                duplicates,
                int(want.size) - n,
                evicted,
            )

    def slots_view(self, key: LayoutKey) -> np.ndarray:
        with self._lock:
            arena = self._arenas.get(key)
            return arena.pages if arena is not None else np.zeros((0, 0), dtype=np.uint8)

    def page_bytes_of(self, key: LayoutKey) -> int:
        with self._lock:
            arena = self._arenas.get(key)
            return arena.page_bytes if arena is not None else 0

    def commit(self, res: Reservation, keep: np.ndarray | None = None) -> int:
        if not res.slots.size:
            return 0
        with self._lock:
            arena = self._arenas[res.key]
            mask = np.ones(res.slots.size, dtype=bool) if keep is None else np.asarray(keep, dtype=bool)
            if mask.shape != res.slots.shape:
                raise InvalidArgument("keep", f"must have one flag per reserved slot ({res.slots.size})")
            arena.slots.hold(res.slots[mask], self._next_tick())
            arena.slots.give_back(res.slots[~mask])
            n = int(np.count_nonzero(mask))
            if n:
                for listener in self.listeners:
                    listener.tier_stored(res.key, res.hashes[mask])
            self.stored_pages += n
            self.stored_bytes += n * arena.page_bytes
            return n

    def abort(self, res: Reservation) -> None:
        if res.slots.size:
            with self._lock:
                self._arenas[res.key].slots.give_back(res.slots)

    # -- serving ---------------------------------------------------------------------------

    def match(self, key: LayoutKey, hashes: np.ndarray, *, touch: bool = True) -> int:
        h = as_hashes(hashes, "hashes")
        with self._lock:
            arena = self._arenas.get(key)
            if arena is None or not h.size:
                return 0
            found = arena.slots.find(h)
            n = int(np.argmin(found >= 0)) if (found < 0).any() else int(h.size)
            if touch:
                arena.slots.tick[found[:n]] = self._next_tick()
                self.hits += n
                self.misses += int(h.size) - n
            return n

    def held(self, key: LayoutKey, hashes: np.ndarray) -> np.ndarray:
        h = as_hashes(hashes, "hashes")
        with self._lock:
            arena = self._arenas.get(key)
            return np.zeros(h.size, dtype=bool) if arena is None else arena.slots.find(h) >= 0

    def begin_load(self, key: LayoutKey, hashes: np.ndarray, field: str = "hashes") -> Load:
        h = as_hashes(hashes, field)
        with self._lock:
            arena = self._arenas.get(key)
            found = arena.slots.find(h) if arena is not None else np.full(h.size, -1, dtype=np.int64)
            missing = np.flatnonzero(found < 0)
            if missing.size:
                self.misses += int(missing.size)
                i = int(missing[0])
                raise FailedPrecondition(
                    f"{field}[{i}]: page {int(h[i]):#018x} is not in the host tier for layout "
                    f"{key.describe()} ({missing.size} of {h.size} pages are not)"
                )
            assert arena is not None
            np.add.at(arena.slots.pins, found, 1)
            np.add.at(arena.load_pins, found, 1)
            arena.slots.tick[found] = self._next_tick()
            self.hits += int(h.size)
            return Load(key, found)

    def end_load(self, load: Load, loaded: bool = True) -> None:
        with self._lock:
            arena = self._arenas[load.key]
            np.subtract.at(arena.slots.pins, load.slots, 1)
            np.subtract.at(arena.load_pins, load.slots, 1)
            if loaded:
                self.loaded_pages += int(load.slots.size)

    # -- leases ----------------------------------------------------------------------------

    def lease(
        self, lease_id: str, owner: str, expires_unix_ms: int, key: LayoutKey, hashes: np.ndarray
    ) -> int:
        h = as_hashes(hashes, "hashes")
        with self._lock:
            arena = self._arenas.get(key)
            if arena is None:
                return 0
            found = arena.slots.find(h)
            n = int(np.argmin(found >= 0)) if (found < 0).any() else int(h.size)
            if n == 0:
                return 0
            rec = self._leases.setdefault(lease_id, _Lease(owner, expires_unix_ms, []))
            if rec.owner != owner:
                raise InvalidArgument("lease_id", "names a lease of another session")
            slots = found[:n].copy()
            rec.parts.append((key, slots))
            np.add.at(arena.slots.pins, slots, 1)
            return n

    def _release(self, lease_id: str) -> None:
        rec = self._leases.pop(lease_id)
        for key, slots in rec.parts:
            np.subtract.at(self._arenas[key].slots.pins, slots, 1)

    def release_lease(self, lease_id: str, owner: str) -> bool:
        with self._lock:
            rec = self._leases.get(lease_id)
            if rec is None:
                return False
            if rec.owner != owner:
                raise PermissionDenied(f"lease {lease_id!r} belongs to another session")
            self._release(lease_id)
            return True

    def release_owner(self, owner: str) -> int:
        with self._lock:
            ids = [i for i, r in self._leases.items() if r.owner == owner]
            for i in ids:
                self._release(i)
            return len(ids)

    def _expire(self, now: int) -> int:
        ids = [i for i, r in self._leases.items() if r.expires_unix_ms <= now]
        for i in ids:
            self._release(i)
        return len(ids)

    def expire_leases(self, now_ms: int | None = None) -> int:
        with self._lock:
            return self._expire(self._clock() if now_ms is None else now_ms)

    def lease_count(self, owner: str) -> int:
        """Live tier leases of ``owner`` (expired ones included until the next expiry pass)."""
        with self._lock:
            return sum(1 for r in self._leases.values() if r.owner == owner)

    def leases(self) -> int:
        with self._lock:
            return len(self._leases)

    # -- reporting -------------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            held = {k: a.slots.held for k, a in self._arenas.items()}
            return TierStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=sum(n * self._arenas[k].page_bytes for k, n in held.items()),
                held_pages=sum(held.values()),
                layouts=len(self._arenas),
                hits=self.hits,
                misses=self.misses,
                evictions=self.evictions,
                stored_pages=self.stored_pages,
                stored_bytes=self.stored_bytes,
                duplicate_pages=self.duplicate_pages,
                loaded_pages=self.loaded_pages,
                fill_backlog_pages=self.backlog(),
            )

    def check_integrity(self) -> None:
        with self._lock:
            expected = {k: a.load_pins.astype(np.int32).copy() for k, a in self._arenas.items()}
            for rec in self._leases.values():
                for key, slots in rec.parts:
                    np.add.at(expected[key], slots, 1)
            for key, arena in self._arenas.items():
                arena.slots.check_integrity(expected[key])
                assert (arena.slots.state[np.flatnonzero(arena.load_pins)] == HELD).all(), (
                    "loads read HELD slots"
                )
            total = sum(a.slots.capacity * a.page_bytes for a in self._arenas.values())
            assert total <= self.capacity_bytes, "the arenas fit in host_tier_gb"
