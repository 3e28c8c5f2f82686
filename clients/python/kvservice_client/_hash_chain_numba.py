"""The sequential part of the canonical page hash, compiled with numba (optional dependency).

``hash[i] = XXH3-64(hash[i-1] || local[i], seed)`` is XXH3's 9-16 byte path at length 16;
``hashing.py`` falls back to one ``xxhash`` call per page when numba is not installed.
"""

from __future__ import annotations

import numpy as np

from .jit_cache import njit

_PMX1 = np.uint64(0x165667919E3779F9)


@njit(nogil=True)
def _fold(a: np.uint64, b: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    m32 = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    a_lo, a_hi, b_lo, b_hi = a & m32, a >> s32, b & m32, b >> s32
    lo_lo, hi_lo, lo_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi
    cross = (lo_lo >> s32) + (hi_lo & m32) + lo_hi
    upper = (hi_lo >> s32) + (cross >> s32) + a_hi * b_hi
    return (a * b) ^ upper


@njit(nogil=True)
def _bswap(x: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    r = np.uint64(0)
    for _ in range(8):
        r = (r << np.uint64(8)) | (x & np.uint64(0xFF))
        x >>= np.uint64(8)
    return r


@njit(nogil=True)
def chain(
    local: np.ndarray, seed: np.uint64, k34: np.uint64, k56: np.uint64, parent: np.uint64
) -> np.ndarray:  # pragma: no cover
    """Chained hashes from local hashes; ``k34``/``k56`` are the secret words XOR-ed as XXH3 does."""
    n = local.shape[0]
    out = np.empty(n, dtype=np.uint64)
    bitflip1 = k34 + seed
    bitflip2 = k56 - seed
    prev = parent
    for i in range(n):
        lo = prev ^ bitflip1
        hi = local[i] ^ bitflip2
        acc = np.uint64(16) + _bswap(lo) + hi + _fold(lo, hi)
        acc ^= acc >> np.uint64(37)
        acc *= _PMX1
        acc ^= acc >> np.uint64(32)
        out[i] = acc
        prev = acc
    return out
