"""Canonical page hashes (DESIGN.md "Page hash"), reproducible in any language::

    local[i] = XXH3-64(token ids of page i as u32 little-endian, seed)
    hash[i]  = XXH3-64(hash[i-1] as u64 LE || local[i] as u64 LE, seed),   hash[-1] = 0

Only full pages are hashed. Known-answer vectors: ``tests/vectors/page_hash.json``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["page_hashes", "tokens_to_u32le"]


def tokens_to_u32le(tokens: Sequence[int] | np.ndarray | bytes) -> bytes:
    """Token ids as packed u32 little-endian bytes (the wire form of TokenIds)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        return bytes(tokens)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in u32")
    return arr.astype("<u4", copy=False).tobytes()


def page_hashes(tokens: Sequence[int] | np.ndarray | bytes, page_size: int, seed: int = 0) -> np.ndarray:
    """Chained hashes of every full page, as a uint64 array of length len(tokens) // page_size."""
    if page_size <= 0:
        raise ValueError("page_size must be > 0")
    data = tokens_to_u32le(tokens)
    step = page_size * 4
    n = len(data) // step
    out = np.empty(n, dtype=np.uint64)
    h = xxhash.xxh3_64_intdigest
    mv = memoryview(data)
    # NOTE: the chain is sequential by definition; one C call per page (no per-token work).
    prev = 0
    for i in range(n):
        local = h(mv[i * step : (i + 1) * step], seed)
        prev = h((prev | (local << 64)).to_bytes(16, "little"), seed)
        out[i] = prev
    return out
