"""``PrefixIndex``: the node's prefix index over all buffer sets (contract in ``base``).

Thread-safe: one lock around every public method (the servicer and the KV-event ingester
threads share one index).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

from kvservice.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unauthenticated

from . import _kernels as K
from ._bufset import BufferSetIndex
from ._leases import LeaseBook, LeasePart, LeaseRecord
from .base import BufferSetSpec, EvictableLeaf, IndexStats, Lease, Match, PrefixIndexBase

__all__ = ["PrefixIndex"]

_EMPTY = np.empty(0, dtype=np.int64)


def _now_ms() -> int:
    return int(time.time() * 1000)


def as_hashes(hashes: Iterable[int] | np.ndarray, field: str = "hashes") -> np.ndarray:
    """A one-dimensional uint64 array, or InvalidArgument naming ``field``."""
    arr = hashes if isinstance(hashes, np.ndarray) else np.asarray(list(hashes), dtype=np.uint64)
    if arr.ndim != 1:
        raise InvalidArgument(field, "must be one-dimensional")
    if arr.dtype != np.uint64:
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidArgument(field, f"must be unsigned 64-bit integers, not {arr.dtype}")
        if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise InvalidArgument(field, "must be unsigned 64-bit integers (negative value)")
        arr = arr.astype(np.uint64)
    return np.ascontiguousarray(arr)


class IndexListener(Protocol):
    """Observer of index changes (e.g. the KV-event re-publisher). Called under the index lock:
    implementations copy what they need and return at once."""

    def stored(
        self, spec: BufferSetSpec, hashes: np.ndarray, parent: int | None, tokens: np.ndarray | None
    ) -> None: ...

    def removed(self, spec: BufferSetSpec, hashes: np.ndarray) -> None: ...


class PrefixIndex(PrefixIndexBase):
    """Radix/chain index of every buffer set on this node."""

    def __init__(self, clock_ms: Callable[[], int] = _now_ms) -> None:
        self._sets: dict[str, BufferSetIndex] = {}
        self._leases = LeaseBook()
        self._lock = threading.RLock()
        self._clock = clock_ms
        self._tick = 0
        self._lookups = self._hit_pages = self._query_pages = 0
        # Told of every change, under the index lock (they must only enqueue): see IndexListener.
        self.listeners: list[IndexListener] = []

    def _set(self, buffer_set_id: str) -> BufferSetIndex:
        bs = self._sets.get(buffer_set_id)
        if bs is None:
            raise NotFound(f"buffer set {buffer_set_id!r} is not registered with the index")
        return bs

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # --- buffer sets -----------------------------------------------------------------------

    def add_buffer_set(
        self,
        buffer_set_id: str,
        *,
        engine_id: str,
        page_size: int,
        num_pages: int,
        tp_rank: int = 0,
        dp_rank: int = 0,
        presence_only: bool = False,
    ) -> BufferSetSpec:
        if not buffer_set_id:
            raise InvalidArgument("buffer_set_id", "must not be empty")
        if page_size <= 0:
            raise InvalidArgument("page_size", "must be > 0")
        if not presence_only and not 0 < num_pages < 2**31:
            raise InvalidArgument("num_pages", "must be in [1, 2**31)")
        spec = BufferSetSpec(buffer_set_id, engine_id, page_size, num_pages, tp_rank, dp_rank, presence_only)
        with self._lock:
            if buffer_set_id in self._sets:
                raise AlreadyExists(f"buffer set {buffer_set_id!r} is already indexed")
            self._sets[buffer_set_id] = BufferSetIndex(spec)
        return spec

    def remove_buffer_set(self, buffer_set_id: str) -> int:
        with self._lock:
            bs = self._set(buffer_set_id)
            if self.listeners and bs.entries:
                live = bs.live_slots()
                for listener in self.listeners:
                    listener.removed(bs.spec, bs.H[live])
            del self._sets[buffer_set_id]
            return bs.entries

    def buffer_sets(self) -> list[BufferSetSpec]:
        with self._lock:
            return [bs.spec for bs in self._sets.values()]

    def indexed_pages(self, buffer_set_id: str) -> int:
        with self._lock:
            return self._set(buffer_set_id).entries

    # --- publish / evict -------------------------------------------------------------------

    def publish(
        self,
        buffer_set_id: str,
        hashes: np.ndarray,
        page_indices: np.ndarray | None,
        priority: int = 0,
        *,
        parent_hash: int | None = None,
        tokens: np.ndarray | None = None,
    ) -> int:
        """Insert a chain; ``tokens`` (u32, the pages' tokens) only travel on to listeners."""
        h = as_hashes(hashes)
        if not -(2**31) <= priority < 2**31:
            raise InvalidArgument("priority", "must fit in int32")
        with self._lock:
            bs = self._set(buffer_set_id)
            inserted, _ = bs.publish(h, page_indices, priority, parent_hash, self._next_tick())
            for listener in self.listeners:
                listener.stored(bs.spec, h, parent_hash, tokens)
            return inserted

    def evict(self, buffer_set_id: str, page_indices: np.ndarray) -> int:
        with self._lock:
            bs = self._set(buffer_set_id)
            if bs.spec.presence_only:
                raise FailedPrecondition(f"buffer set {buffer_set_id} is presence-only: evict by hash")
            slots = bs.page_slot[bs.check_pages(page_indices)]
            return self._remove(bs, slots[slots >= 0])

    def evict_hashes(self, buffer_set_id: str, hashes: np.ndarray) -> int:
        h = as_hashes(hashes)
        with self._lock:
            bs = self._set(buffer_set_id)
            slots = bs.find(h)
            return self._remove(bs, slots[slots >= 0])

    def evict_all(self, buffer_set_id: str) -> int:
        with self._lock:
            bs = self._set(buffer_set_id)
            live = bs.live_slots()
            return self._remove(bs, live[bs.E[live, K.PARENT] == 0])

    def _remove(self, bs: BufferSetIndex, slots: np.ndarray) -> int:
        """Remove the subtrees of ``slots``; listeners learn every hash that went."""
        if not self.listeners:
            return bs.remove(slots)
        # NOTE: O(entries of the buffer set) per removal, paid only while a listener (the event
        # re-publisher) is attached: the compiled subtree removal does not report what it freed.
        live = bs.live_slots()
        removed = bs.remove(slots)
        if removed:
            gone = bs.H[live[bs.E[live, K.PARENT] == K.FREE]]
            for listener in self.listeners:
                listener.removed(bs.spec, gone)
        return removed

    # --- match and leases ------------------------------------------------------------------

    def match(
        self,
        hashes: np.ndarray,
        *,
        page_size: int,
        buffer_set_ids: list[str] | None = None,
        dp_rank: int | None = None,
        scores_only: bool = False,
    ) -> list[Match]:
        h = as_hashes(hashes)
        if page_size < 0:
            raise InvalidArgument("page_size", "must be >= 0")
        with self._lock:
            if buffer_set_ids:
                cands = [self._set(i) for i in dict.fromkeys(buffer_set_ids)]
            else:
                cands = list(self._sets.values())
            cands = [
                bs for bs in cands
                if (page_size == 0 or bs.spec.page_size == page_size)
                and (dp_rank is None or bs.spec.dp_rank == dp_rank)
            ]  # fmt: skip
            now, out = self._next_tick(), []
            for bs in cands:
                slots = bs.walk(h)
                if not scores_only:  # a router's probe is not a use: recency stays the engine's
                    bs.tick[slots] = now
                rows = bs.E[slots]
                pages = _EMPTY if scores_only or bs.spec.presence_only else rows[:, K.PAGE].astype(np.int64)
                s = bs.spec
                minp = int(rows[:, K.PRIO].min()) if slots.size else 0
                out.append(
                    Match(s.buffer_set_id, s.engine_id, s.tp_rank, s.dp_rank, int(slots.size), pages, minp)
                )
            out.sort(key=lambda m: -m.matched_pages)
            self._lookups += 1
            self._query_pages += int(h.size)
            self._hit_pages += out[0].matched_pages if out else 0
            return out

    def lease(self, matches: list[Match], ttl_ms: int, owner: str, *, now_ms: int | None = None) -> Lease:
        if ttl_ms <= 0:
            raise InvalidArgument("lease_ttl_ms", "must be > 0")
        if not owner:
            raise Unauthenticated("a lease needs a session (kvservice-session metadata)")
        with self._lock:
            parts = []
            for m in matches:
                bs = self._set(m.buffer_set_id)
                if m.matched_pages == 0 or bs.spec.presence_only:
                    continue  # presence-only sets name no pages: nothing to pin
                if m.page_indices.size != m.matched_pages:
                    raise InvalidArgument("scores_only", "a scores-only match cannot be leased")
                pages = m.page_indices.astype(np.int32)
                slots = bs.page_slot[pages]
                if (slots < 0).any():
                    raise FailedPrecondition(f"buffer set {m.buffer_set_id}: matched pages were evicted")
                parts.append(LeasePart(m.buffer_set_id, slots, bs.E[slots, K.EPOCH].copy(), pages))
            expires = (self._clock() if now_ms is None else now_ms) + ttl_ms
            rec = self._leases.add(owner, expires, parts, self._sets)
            return _lease(rec)

    def lease_count(self, owner: str) -> int:
        """Live leases of ``owner`` (a session)."""
        with self._lock:
            return self._leases.per_owner.get(owner, 0)

    def check_lease(self, lease_id: str, owner: str) -> None:
        with self._lock:
            rec = self._leases.get(lease_id, owner)
            if rec.expires_unix_ms <= self._clock():
                self._leases.release(lease_id, self._sets)
                raise NotFound(f"lease {lease_id!r} expired")
            self._leases.check(rec, self._sets)

    def release_lease(self, lease_id: str, owner: str) -> None:
        with self._lock:
            self._leases.get(lease_id, owner)
            self._leases.release(lease_id, self._sets)

    def release_owner(self, owner: str) -> int:
        with self._lock:
            return self._leases.release_where(lambda r: r.owner == owner, self._sets)

    def expire_leases(self, now_ms: int | None = None) -> int:
        with self._lock:
            now = self._clock() if now_ms is None else now_ms
            return self._leases.release_where(lambda r: r.expires_unix_ms <= now, self._sets)

    # --- P/D duplicates and eviction suggestions --------------------------------------------

    def mark_duplicates(
        self, buffer_set_id: str, page_indices: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mark the indexed entries on ``page_indices`` as also held by another engine; returns
        (slots, epochs, hashes) of the entries marked (pages holding no entry are skipped)."""
        with self._lock:
            bs = self._set(buffer_set_id)
            pages = np.unique(bs.check_pages(page_indices))
            slots = bs.page_slot[pages]
            slots = slots[slots >= 0]
            return slots, bs.mark(slots, self._next_tick()), bs.H[slots].copy()

    def unmark_duplicates(self, buffer_set_id: str, slots: np.ndarray, epochs: np.ndarray) -> None:
        """Undo ``mark_duplicates`` for these entries (a no-op for entries since evicted)."""
        with self._lock:
            bs = self._sets.get(buffer_set_id)
            if bs is not None and slots.size:
                bs.unmark(slots, epochs)

    def entries_alive(self, buffer_set_id: str, slots: np.ndarray, epochs: np.ndarray) -> np.ndarray:
        """Whether each entry is still the one ``mark_duplicates`` returned (not evicted since)."""
        with self._lock:
            bs = self._sets.get(buffer_set_id)
            if bs is None:
                return np.zeros(slots.size, dtype=bool)
            return (bs.E[slots, K.PARENT] != K.FREE) & (bs.E[slots, K.EPOCH] == epochs)

    def duplicated_pages(self, buffer_set_id: str) -> int:
        with self._lock:
            bs = self._set(buffer_set_id)
            live = bs.live_slots()
            return int(np.count_nonzero(bs.duplicated(live)))

    def page_entries(
        self, buffer_set_id: str, hashes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(hashes, page indices, slots, epochs) of the hashes indexed with a page in the buffer
        set, in query order; absent hashes and presence-only sets give nothing. With
        ``entries_alive`` a copier learns whether a page was evicted while it read it."""
        h = as_hashes(hashes)
        with self._lock:
            bs = self._set(buffer_set_id)
            if bs.spec.presence_only:
                return h[:0], _EMPTY, _EMPTY.astype(np.int32), _EMPTY.astype(np.int32)
            slots = bs.find(h)
            ok = slots >= 0
            slots = slots[ok]
            return h[ok], bs.E[slots, K.PAGE].astype(np.int64), slots, bs.E[slots, K.EPOCH].copy()

    def hashes_at(self, buffer_set_id: str, page_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hash, indexed) of each page index of the buffer set (hash 0 where none is indexed)."""
        with self._lock:
            bs = self._set(buffer_set_id)
            pages = bs.check_pages(page_indices)
            slots = bs.page_slot[pages]
            ok = slots >= 0
            return np.where(ok, bs.H[np.maximum(slots, 0)], np.uint64(0)).astype(np.uint64), ok

    def held(self, buffer_set_id: str, hashes: np.ndarray) -> np.ndarray:
        """Whether each hash is indexed in the buffer set (bool array)."""
        h = as_hashes(hashes)
        with self._lock:
            return self._set(buffer_set_id).find(h) >= 0

    def suggest_evictions(
        self, buffer_set_id: str, max_pages: int, dup_priority: int | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(page indices, effective priorities, duplicated) of up to ``max_pages`` entries to
        evict first; see ``BufferSetIndex.eviction_order``. Never a leased page."""
        with self._lock:
            bs = self._set(buffer_set_id)
            if bs.spec.presence_only:
                raise FailedPrecondition(f"buffer set {buffer_set_id} is presence-only: it names no pages")
            slots, prios = bs.eviction_order(dup_priority)
            slots, prios = slots[:max_pages], prios[:max_pages]
            return bs.E[slots, K.PAGE].copy(), prios.astype(np.int32), bs.duplicated(slots)

    # --- reporting -------------------------------------------------------------------------

    def evictable_leaves(self, buffer_set_id: str, limit: int) -> list[EvictableLeaf]:
        with self._lock:
            bs = self._set(buffer_set_id)
            slots = bs.leaves()[: max(limit, 0)]
            pages, prios, hashes = (
                bs.E[slots, K.PAGE].tolist(),
                bs.E[slots, K.PRIO].tolist(),
                bs.H[slots].tolist(),
            )
            return [EvictableLeaf(p, q, h) for p, q, h in zip(pages, prios, hashes, strict=True)]

    def stats(self) -> IndexStats:
        with self._lock:
            prios = [bs.E[bs.live_slots(), K.PRIO] for bs in self._sets.values()]
            values, counts = np.unique(np.concatenate(prios) if prios else _EMPTY, return_counts=True)
            return IndexStats(
                entries=sum(bs.entries for bs in self._sets.values()),
                leases=len(self._leases),
                lookups=self._lookups,
                hit_pages=self._hit_pages,
                query_pages=self._query_pages,
                entries_by_priority={
                    int(v): int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)
                },
                buffer_sets=len(self._sets),
                bytes_used=sum(bs.nbytes for bs in self._sets.values()),
            )

    def check_integrity(self) -> None:
        with self._lock:
            for bs in self._sets.values():
                bs.check_integrity()
            expected = self._leases.expected_pins(self._sets)
            for k, bs in self._sets.items():
                live = bs.live_slots()
                assert (bs.E[live, K.PINS] == expected[k][live]).all(), f"{k}: pins equal live leases"


def _lease(rec: LeaseRecord) -> Lease:
    return Lease(rec.lease_id, rec.owner, rec.expires_unix_ms, sum(int(p.slots.size) for p in rec.parts))
