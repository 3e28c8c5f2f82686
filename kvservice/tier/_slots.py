"""Slot bookkeeping of one arena: states, the free stack, hashes, recency, pins, and the hash
table (the index's numba open-addressing table, sized once: an arena never grows).

::

    slot     0      1      2        3      ...  capacity-1
    state    HELD   FREE   FILLING  HELD
    H        h0     -      h7       h3          (H of a FILLING slot is the hash it will hold)
    free     [1, ...]                           a stack: the top is free[nfree - 1]

Not thread-safe: the tier calls it under its lock. Every bulk operation is one numpy or numba
call, never a Python loop per page.
"""

from __future__ import annotations

import numpy as np

from ..index import _kernels as K

try:
    from kvservice_client.jit_cache import njit

    _jit = njit(nogil=True)
except ImportError:  # NOTE: pure-Python fallback, same results, far slower; numba is a dependency

    def _jit(fn):  # type: ignore[no-untyped-def]
        return fn


__all__ = ["FILLING", "FREE", "HELD", "Slots"]

FREE, FILLING, HELD = 0, 1, 2


@_jit
def _insert_many(
    tk: np.ndarray, tv: np.ndarray, shift: int, keys: np.ndarray, vals: np.ndarray
) -> None:  # pragma: no cover
    for i in range(keys.shape[0]):
        K.t_insert(tk, tv, shift, keys[i], vals[i])


@_jit
def _delete_many(tk: np.ndarray, tv: np.ndarray, shift: int, keys: np.ndarray) -> None:  # pragma: no cover
    for i in range(keys.shape[0]):
        K.t_delete(tk, tv, shift, keys[i])


class Slots:
    """The bookkeeping of ``capacity`` slots."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.state = np.zeros(capacity, dtype=np.int8)
        self.H = np.zeros(capacity, dtype=np.uint64)
        self.tick = np.zeros(capacity, dtype=np.int64)
        self.pins = np.zeros(capacity, dtype=np.int32)
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: slot 0 pops first
        self.nfree = capacity
        size = 1 << max(4, int(np.ceil(np.log2(max(capacity, 1) / 0.5))))  # load factor <= 0.5
        self._tk = np.zeros(size, dtype=np.uint64)
        self._tv = np.full(size, -1, dtype=np.int32)
        self._shift = 64 - (size.bit_length() - 1)

    @property
    def held(self) -> int:
        return int(np.count_nonzero(self.state == HELD))

    def find(self, hashes: np.ndarray) -> np.ndarray:
        """HELD slot of each hash, -1 where absent (int64)."""
        return K.t_find_many(self._tk, self._tv, self._shift, hashes).astype(np.int64)

    def filling(self, hashes: np.ndarray) -> np.ndarray:
        """Whether each hash is being filled now (a reservation holds it)."""
        busy = np.flatnonzero(self.state == FILLING)
        return np.isin(hashes, self.H[busy]) if busy.size else np.zeros(hashes.size, dtype=bool)

    def take(self, n: int) -> np.ndarray:
        """Pop ``n`` FREE slots (the caller checked ``n <= nfree``) and mark them FILLING."""
        got = self.free[self.nfree - n : self.nfree][::-1].copy()
        self.nfree -= n
        self.state[got] = FILLING
        return got

    def give_back(self, slots: np.ndarray) -> None:
        """FILLING or unpinned HELD slots go FREE (HELD ones leave the table)."""
        held = slots[self.state[slots] == HELD]
        if held.size:
            _delete_many(self._tk, self._tv, self._shift, self.H[held])
        self.state[slots] = FREE
        self.H[slots] = 0
        self.tick[slots] = 0
        self.free[self.nfree : self.nfree + slots.size] = slots
        self.nfree += slots.size

    def hold(self, slots: np.ndarray, now: int) -> None:
        """FILLING slots (their H set) become HELD and enter the table."""
        _insert_many(self._tk, self._tv, self._shift, self.H[slots], slots.astype(np.int32))
        self.state[slots] = HELD
        self.tick[slots] = now

    def victims(self, n: int) -> np.ndarray:
        """Up to ``n`` unpinned HELD slots, least recently used first."""
        cand = np.flatnonzero((self.state == HELD) & (self.pins == 0))
        if cand.size > n:
            cand = cand[np.argpartition(self.tick[cand], n - 1)[:n]]
        return cand[np.argsort(self.tick[cand], kind="stable")]

    def check_integrity(self, expected_pins: np.ndarray) -> None:
        st = self.state
        free = self.free[: self.nfree]
        assert np.unique(free).size == free.size, "a slot is on the free stack twice"
        assert (st[free] == FREE).all() and self.nfree == np.count_nonzero(st == FREE), (
            "the free stack holds exactly the FREE slots"
        )
        n_free, n_fill, n_held = (int(np.count_nonzero(st == s)) for s in (FREE, FILLING, HELD))
        assert n_free + n_fill + n_held == self.capacity, "free + filling + held == capacity"
        held = np.flatnonzero(st == HELD)
        assert np.unique(self.H[held]).size == held.size, "a hash is held twice"
        assert (self.find(self.H[held]) == held).all(), "every HELD slot is in the table under its hash"
        assert int(np.count_nonzero(self._tv != -1)) == held.size, "the table holds only HELD slots"
        assert (self.pins == expected_pins).all(), "pins equal live leases plus loads in progress"
        assert (self.pins[st != HELD] == 0).all(), "only HELD slots are pinned"
