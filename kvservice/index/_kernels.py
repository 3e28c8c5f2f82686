"""Compiled (numba) loops of the index: an open-addressing hash table and the entry tree.

Hash table: linear probing, capacity a power of two, ``tvals == -1`` marks an empty bucket
(keys may be any u64, 0 included), backward-shift deletion (no tombstones).

Entry table ``E`` (int32, one row per slot; slot 0 is the root and is never in the hash table)::

    column  PARENT  CHILD        NEXT          PREV          PAGE     PRIO      PINS    EPOCH
    value   slot    first child  next sibling  prev sibling  page/-1  priority  leases  reuse count
    free slot: PARENT == FREE (-2); root: PARENT == -1
"""

from __future__ import annotations

import numpy as np

try:
    from kvservice_client.jit_cache import njit

    _jit = njit(nogil=True)
except ImportError:  # NOTE: pure-Python fallback, same results, far slower; numba is a dependency

    def _jit(fn):  # type: ignore[no-untyped-def]
        return fn


PARENT, CHILD, NEXT, PREV, PAGE, PRIO, PINS, EPOCH = range(8)
NCOLS = 8
FREE = -2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@_jit
def _home(key: np.uint64, shift: int) -> np.int64:  # pragma: no cover
    return np.int64((key * _GOLDEN) >> np.uint64(shift))


@_jit
def t_find(tk: np.ndarray, tv: np.ndarray, shift: int, key: np.uint64) -> int:  # pragma: no cover
    mask = np.int64(tv.shape[0] - 1)
    b = _home(key, shift)
    while True:
        v = tv[b]
        if v == -1:
            return -1
        if tk[b] == key:
            return v
        b = (b + 1) & mask


@_jit
def t_find_many(
    tk: np.ndarray, tv: np.ndarray, shift: int, keys: np.ndarray
) -> np.ndarray:  # pragma: no cover
    out = np.empty(keys.shape[0], dtype=np.int32)
    for i in range(keys.shape[0]):
        out[i] = t_find(tk, tv, shift, keys[i])
    return out


@_jit
def t_insert(
    tk: np.ndarray, tv: np.ndarray, shift: int, key: np.uint64, val: int
) -> None:  # pragma: no cover
    """Insert a key known to be absent; the caller keeps the load factor below 1."""
    mask = np.int64(tv.shape[0] - 1)
    b = _home(key, shift)
    while tv[b] != -1:
        b = (b + 1) & mask
    tk[b] = key
    tv[b] = val


@_jit
def t_delete(tk: np.ndarray, tv: np.ndarray, shift: int, key: np.uint64) -> None:  # pragma: no cover
    mask = np.int64(tv.shape[0] - 1)
    i = _home(key, shift)
    while tv[i] != -1 and tk[i] != key:
        i = (i + 1) & mask
    if tv[i] == -1:
        return
    j = i
    while True:  # NOTE: shift back every later key whose home bucket is not in (i, j]
        j = (j + 1) & mask
        if tv[j] == -1:
            break
        home = _home(tk[j], shift)
        if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
            tk[i] = tk[j]
            tv[i] = tv[j]
            i = j
    tv[i] = -1


@_jit
def t_rehash(
    tk: np.ndarray, tv: np.ndarray, nk: np.ndarray, nv: np.ndarray, nshift: int
) -> None:  # pragma: no cover
    for b in range(tv.shape[0]):
        if tv[b] != -1:
            t_insert(nk, nv, nshift, tk[b], tv[b])


@_jit
def walk(
    tk: np.ndarray, tv: np.ndarray, shift: int, E: np.ndarray, hashes: np.ndarray, start: int, out: np.ndarray
) -> int:  # pragma: no cover
    """Follow ``hashes`` down from slot ``start``; writes matched slots to ``out``; returns count."""
    prev = start
    for i in range(hashes.shape[0]):
        s = t_find(tk, tv, shift, hashes[i])
        if s < 0 or E[s, PARENT] != prev:
            return i
        out[i] = s
        prev = s
    return hashes.shape[0]


@_jit
def insert_chain(
    tk: np.ndarray,
    tv: np.ndarray,
    shift: int,
    E: np.ndarray,
    H: np.ndarray,
    tick: np.ndarray,
    free: np.ndarray,
    nfree: int,
    page_slot: np.ndarray,
    hashes: np.ndarray,
    pages: np.ndarray,
    parent: int,
    prio: int,
    now: int,
) -> tuple[int, int]:  # pragma: no cover
    """Insert/refresh a validated chain under ``parent``; ``pages`` empty = presence-only.

    Returns (inserted, nfree). The caller reserved ``len(hashes)`` free slots and table room.
    """
    inserted = 0
    prev = parent
    for i in range(hashes.shape[0]):
        s = t_find(tk, tv, shift, hashes[i])
        if s >= 0:
            if prio > E[s, PRIO]:
                E[s, PRIO] = prio
        else:
            nfree -= 1
            s = free[nfree]
            H[s] = hashes[i]
            E[s, PARENT] = prev
            E[s, CHILD] = -1
            E[s, PREV] = -1
            first = E[prev, CHILD]
            E[s, NEXT] = first
            if first >= 0:
                E[first, PREV] = s
            E[prev, CHILD] = s
            E[s, PAGE] = -1
            if pages.shape[0] > 0:
                E[s, PAGE] = pages[i]
                page_slot[pages[i]] = s
            E[s, PRIO] = prio
            E[s, PINS] = 0
            E[s, EPOCH] += 1
            t_insert(tk, tv, shift, hashes[i], s)
            inserted += 1
        tick[s] = now
        prev = s
    return inserted, nfree


@_jit
def remove_subtrees(
    tk: np.ndarray,
    tv: np.ndarray,
    shift: int,
    E: np.ndarray,
    H: np.ndarray,
    free: np.ndarray,
    nfree: int,
    page_slot: np.ndarray,
    roots: np.ndarray,
) -> tuple[int, int]:  # pragma: no cover
    """Free every slot in the subtrees of ``roots`` (already-freed roots are skipped).

    Returns (removed, nfree).
    """
    removed = 0
    stack = np.empty(E.shape[0], dtype=np.int32)
    for r in roots:
        if r <= 0 or E[r, PARENT] == FREE:
            continue
        p, nx, pv = E[r, PARENT], E[r, NEXT], E[r, PREV]  # unlink r from its siblings
        if pv >= 0:
            E[pv, NEXT] = nx
        else:
            E[p, CHILD] = nx
        if nx >= 0:
            E[nx, PREV] = pv
        top = 0
        stack[top] = r
        top += 1
        while top > 0:
            top -= 1
            s = stack[top]
            c = E[s, CHILD]
            while c >= 0:
                stack[top] = c
                top += 1
                c = E[c, NEXT]
            t_delete(tk, tv, shift, H[s])
            if E[s, PAGE] >= 0:
                page_slot[E[s, PAGE]] = -1
            E[s, PARENT] = FREE
            E[s, CHILD] = -1
            E[s, PAGE] = -1
            E[s, PINS] = 0
            free[nfree] = s
            nfree += 1
            removed += 1
    return removed, nfree


@_jit
def is_in_subtree(E: np.ndarray, node: int, root: int) -> bool:  # pragma: no cover
    """True when ``node`` is ``root`` or one of its descendants (walks parents up from node)."""
    while node > 0:
        if node == root:
            return True
        node = E[node, PARENT]
    return node == root


@_jit
def eviction_order(
    E: np.ndarray, aggp: np.ndarray, aggt: np.ndarray, blocked: np.ndarray, pos: np.ndarray
) -> int:  # pragma: no cover
    """Post-order walk of the tree from the root: each entry's ``pos`` comes after its
    descendants', and ``aggp`` / ``aggt`` / ``blocked`` (initialised per entry by the caller)
    become the max / max / any over the entry's subtree. Returns entries visited."""
    cur = E[0, CHILD]
    if cur < 0:
        return 0
    while E[cur, CHILD] >= 0:
        cur = E[cur, CHILD]
    k = 0
    while True:
        pos[cur] = k
        k += 1
        p = E[cur, PARENT]
        if p > 0:
            if aggp[cur] > aggp[p]:
                aggp[p] = aggp[cur]
            if aggt[cur] > aggt[p]:
                aggt[p] = aggt[cur]
            if blocked[cur]:
                blocked[p] = True
        nxt = E[cur, NEXT]
        if nxt >= 0:
            cur = nxt
            while E[cur, CHILD] >= 0:
                cur = E[cur, CHILD]
        else:
            cur = p
            if cur <= 0:
                return k
