"""The index of one buffer set: numpy-backed entry rows plus a hash table (see ``_kernels``).

Memory per entry: 8 (hash) + 32 (row) + 8 (recency) + 8 (duplicate mark) bytes, plus 12 bytes
per hash-table bucket at a load factor kept in [0.35, 0.7]; plus 4 bytes per page of the pool
(page -> slot).
"""

from __future__ import annotations

import numpy as np

from kvservice.errors import FailedPrecondition, InvalidArgument

from . import _kernels as K
from .base import BufferSetSpec

_MAX_LOAD = 0.7


class BufferSetIndex:
    """Entries of one buffer set. Callers validate ids; this class validates page/hash input."""

    def __init__(self, spec: BufferSetSpec, capacity: int = 1024) -> None:
        self.spec = spec
        self.E = np.full((capacity, K.NCOLS), -1, dtype=np.int32)
        self.E[:, K.PARENT] = K.FREE
        self.E[:, K.EPOCH] = 0
        self.E[0, K.PARENT] = -1  # the root
        self.H = np.zeros(capacity, dtype=np.uint64)
        self.tick = np.zeros(capacity, dtype=np.int64)
        # P/D duplicate marks: how many receivers hold the entry's page too, valid while the
        # entry's EPOCH equals dup_epoch (a reused slot starts unmarked).
        self.dup = np.zeros(capacity, dtype=np.int32)
        self.dup_epoch = np.zeros(capacity, dtype=np.int32)
        self.dup_tick = np.zeros(capacity, dtype=np.int64)  # when last marked
        self.free = np.arange(capacity - 1, 0, -1, dtype=np.int32)  # a stack: slot 1 pops first
        self.nfree = capacity - 1
        self.page_slot = np.full(max(spec.num_pages, 0) if not spec.presence_only else 0, -1, dtype=np.int32)
        self._tk = np.zeros(2048, dtype=np.uint64)
        self._tv = np.full(2048, -1, dtype=np.int32)
        self._shift = 64 - 11

    # --- sizes and growth ------------------------------------------------------------------

    @property
    def entries(self) -> int:
        return self.E.shape[0] - 1 - self.nfree

    @property
    def nbytes(self) -> int:
        arrays = (
            self.E,
            self.H,
            self.tick,
            self.dup,
            self.dup_epoch,
            self.free,
            self.page_slot,
            self._tk,
            self._tv,
        )
        return sum(a.nbytes for a in arrays)

    def _reserve(self, extra: int) -> None:
        if extra > self.nfree:
            old = self.E.shape[0]
            new = max(2 * old, old + extra - self.nfree)
            E = np.full((new, K.NCOLS), -1, dtype=np.int32)
            E[:, K.PARENT] = K.FREE
            E[:, K.EPOCH] = 0
            E[:old] = self.E
            self.E = E
            self.H = np.concatenate([self.H, np.zeros(new - old, np.uint64)])
            self.tick = np.concatenate([self.tick, np.zeros(new - old, np.int64)])
            self.dup = np.concatenate([self.dup, np.zeros(new - old, np.int32)])
            self.dup_epoch = np.concatenate([self.dup_epoch, np.zeros(new - old, np.int32)])
            self.dup_tick = np.concatenate([self.dup_tick, np.zeros(new - old, np.int64)])
            free = np.empty(new, dtype=np.int32)
            free[: self.nfree] = self.free[: self.nfree]
            free[self.nfree : self.nfree + new - old] = np.arange(new - 1, old - 1, -1, dtype=np.int32)
            self.free, self.nfree = free, self.nfree + new - old
        want = self.entries + extra
        if want > _MAX_LOAD * self._tv.shape[0]:
            cap = self._tv.shape[0]
            while want > 0.35 * cap:
                cap *= 2
            nk, nv = np.zeros(cap, np.uint64), np.full(cap, -1, np.int32)
            nshift = 64 - (cap.bit_length() - 1)
            K.t_rehash(self._tk, self._tv, nk, nv, nshift)
            self._tk, self._tv, self._shift = nk, nv, nshift

    # --- queries ---------------------------------------------------------------------------

    def find(self, hashes: np.ndarray) -> np.ndarray:
        """Slot of each hash, -1 where absent (int32)."""
        return K.t_find_many(self._tk, self._tv, self._shift, hashes)

    def walk(self, hashes: np.ndarray, start: int = 0) -> np.ndarray:
        """Slots of the longest chain of ``hashes`` present below ``start``."""
        out = np.empty(hashes.shape[0], dtype=np.int32)
        n = K.walk(self._tk, self._tv, self._shift, self.E, hashes, start, out)
        return out[:n]

    # --- mutations -------------------------------------------------------------------------

    def check_pages(self, page_indices: np.ndarray, field: str = "page_indices") -> np.ndarray:
        """Validated int32 page indices: in range and distinct."""
        pages = np.asarray(page_indices)
        if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "iu"):
            raise InvalidArgument(field, "must be a one-dimensional array of integers")
        if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= self.spec.num_pages):
            bad = int(pages[(pages < 0) | (pages >= self.spec.num_pages)][0])
            raise InvalidArgument(field, f"page index {bad} is outside [0, {self.spec.num_pages})")
        if np.unique(pages).size != pages.size:
            raise InvalidArgument(field, "duplicate page indices")
        return pages.astype(np.int32)

    def publish(
        self, hashes: np.ndarray, pages: np.ndarray | None, priority: int, parent_hash: int | None, now: int
    ) -> tuple[int, np.ndarray]:
        """See ``PrefixIndexBase.publish``. Returns (inserted, slots evicted as reused pages)."""
        if self.spec.presence_only:
            if pages is not None:
                raise InvalidArgument("page_indices", "a presence-only buffer set takes no page indices")
            pages_arr = np.empty(0, np.int32)
            k = hashes.shape[0]
        else:
            if pages is None:
                raise InvalidArgument("page_indices", "required for a buffer set with pages")
            pages_arr = self.check_pages(pages)
            k = pages_arr.shape[0]
            if k > hashes.shape[0]:
                raise InvalidArgument("page_indices", f"{k} page indices for {hashes.shape[0]} hashes")
        hashes = hashes[:k]
        # NOTE: small chains (KV events: a few blocks each) are checked without numpy's sort.
        distinct = len(set(hashes.tolist())) if k <= 64 else int(np.unique(hashes).size)
        if distinct != k:
            raise InvalidArgument("hashes", "repeated hash in one sequence (hashes must be chained)")
        parent = 0
        if parent_hash is not None:  # one probe pass for the parent and the chain
            found = self.find(np.concatenate([np.array([parent_hash], np.uint64), hashes]))
            parent, existing = int(found[0]), found[1:]
            if parent < 0:
                raise FailedPrecondition(f"parent hash {parent_hash:#x} is not indexed")
        else:
            existing = self.find(hashes)
        expected = np.concatenate([np.array([parent], np.int32), existing[:-1]]) if k else existing
        bad = np.flatnonzero((existing >= 0) & (self.E[np.maximum(existing, 0), K.PARENT] != expected))
        if bad.size:
            raise InvalidArgument("hashes", f"hash at position {int(bad[0])} is indexed under another prefix")
        reused = self._reused_page_slots(hashes, pages_arr, parent)
        self._reserve(k)
        if reused.size:
            self.remove(reused)
        inserted, self.nfree = K.insert_chain(
            self._tk, self._tv, self._shift, self.E, self.H, self.tick, self.free, self.nfree,
            self.page_slot, hashes, pages_arr, parent, priority, now,
        )  # fmt: skip
        return int(inserted), reused

    def _reused_page_slots(self, hashes: np.ndarray, pages: np.ndarray, parent: int) -> np.ndarray:
        """Entries sitting on pages this publish names for other hashes (to evict first)."""
        if pages.size == 0:
            return np.empty(0, np.int32)
        occ = self.page_slot[pages]
        other = occ[(occ >= 0) & (self.H[np.maximum(occ, 0)] != hashes)]
        if other.size == 0:
            return other
        clash = np.isin(self.H[other], hashes)
        if clash.any():
            h = int(self.H[other[clash][0]])
            raise FailedPrecondition(f"hash {h:#x} is indexed at another page than this publish names")
        for s in other.tolist():
            if parent and K.is_in_subtree(self.E, parent, s):
                raise FailedPrecondition(f"page {int(self.E[s, K.PAGE])} holds an ancestor of parent_hash")
        return other

    def remove(self, slots: np.ndarray) -> int:
        """Free the subtrees of ``slots`` (int32 slot numbers); returns entries removed."""
        removed, self.nfree = K.remove_subtrees(
            self._tk, self._tv, self._shift, self.E, self.H, self.free, self.nfree, self.page_slot,
            slots.astype(np.int32),
        )  # fmt: skip
        return int(removed)

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.E[1:, K.PARENT] != K.FREE).astype(np.int32) + 1

    def leaves(self) -> np.ndarray:
        """Unpinned leaf slots, lowest priority then least recently used first."""
        live = self.live_slots()
        rows = self.E[live]
        leaf = live[(rows[:, K.CHILD] == -1) & (rows[:, K.PINS] == 0)]
        return leaf[np.lexsort((self.tick[leaf], self.E[leaf, K.PRIO]))]

    # --- P/D duplicates and eviction order ---------------------------------------------------

    def duplicated(self, slots: np.ndarray) -> np.ndarray:
        """Whether each (live) slot carries a valid duplicate mark."""
        return (self.dup[slots] > 0) & (self.dup_epoch[slots] == self.E[slots, K.EPOCH])

    def mark(self, slots: np.ndarray, now: int) -> np.ndarray:
        """Add one duplicate mark to each of ``slots`` (distinct, live) at tick ``now``; returns
        their epochs."""
        epochs = self.E[slots, K.EPOCH].copy()
        stale = self.dup_epoch[slots] != epochs
        self.dup[slots[stale]] = 0
        self.dup_epoch[slots] = epochs
        self.dup_tick[slots] = now
        self.dup[slots] += 1
        return epochs

    def unmark(self, slots: np.ndarray, epochs: np.ndarray) -> None:
        """Remove one mark from each slot still holding the entry it was marked on."""
        same = (self.dup_epoch[slots] == epochs) & (self.E[slots, K.EPOCH] == epochs) & (self.dup[slots] > 0)
        self.dup[slots[same]] -= 1

    def eviction_order(self, dup_priority: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(slots, effective priorities) of every entry that may be evicted, first to go first:
        lowest priority, then least recently used, each entry after the entries extending it;
        an entry with a leased page in its subtree never appears. With ``dup_priority``, a
        duplicated entry not used here since it was marked has a priority of at most that (one
        used again, e.g. a shared system prompt, is in use on this side and keeps its own)."""
        live = self.live_slots()
        prio = self.E[:, K.PRIO].astype(np.int64)
        if dup_priority is not None and live.size:
            dup = live[self.duplicated(live)]
            dup = dup[self.tick[dup] <= self.dup_tick[dup]]
            prio[dup] = np.minimum(prio[dup], dup_priority)
        aggp, aggt = prio.copy(), self.tick.copy()  # become the subtree max in the walk
        blocked = self.E[:, K.PINS] > 0
        pos = np.full(self.E.shape[0], -1, dtype=np.int64)
        K.eviction_order(self.E, aggp, aggt, blocked, pos)
        ok = live[~blocked[live]]
        order = ok[np.lexsort((pos[ok], aggt[ok], aggp[ok]))]
        return order, prio[order]

    # --- integrity -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        E, live = self.E, self.live_slots()
        n = self.E.shape[0]
        assert self.nfree + live.size + 1 == n, "slot conservation: free + live + root == capacity"
        assert np.unique(self.free[: self.nfree]).size == self.nfree, "free slots distinct"
        assert (E[self.free[: self.nfree], K.PARENT] == K.FREE).all(), "free slots are marked free"
        parents = E[live, K.PARENT]
        assert ((parents == 0) | (E[np.maximum(parents, 0), K.PARENT] != K.FREE)).all(), "parents live"
        assert (self.find(self.H[live]) == live).all(), "hash table maps each live hash to its slot"
        assert int((self._tv != -1).sum()) == live.size, "hash table holds only live entries"
        assert (E[live, K.PINS] >= 0).all(), "pin counts non-negative"
        children = np.zeros(n, np.int64)
        for s in [0, *live.tolist()]:  # sibling lists: each child listed once, under its parent
            c, prev = int(E[s, K.CHILD]), -1
            while c >= 0:
                assert E[c, K.PARENT] == s and E[c, K.PREV] == prev, "child list consistent"
                children[c] += 1
                prev, c = c, int(E[c, K.NEXT])
        assert (children[live] == 1).all(), "every live entry is in exactly one child list"
        pages = E[live, K.PAGE]
        if self.spec.presence_only:
            assert (pages == -1).all(), "presence-only entries hold no page index"
            return
        assert ((pages >= 0) & (pages < self.spec.num_pages)).all(), "page indices in [0, num_pages)"
        assert np.unique(pages).size == pages.size, "a page index is held by one entry"
        assert (self.page_slot[pages] == live).all(), "page -> slot map agrees with entries"
        assert int((self.page_slot >= 0).sum()) == live.size, "page -> slot map has no stale pages"
