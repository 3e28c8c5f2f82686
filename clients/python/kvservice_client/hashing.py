"""Canonical page hashes (DESIGN.md "Page hash"), reproducible in any language::

    local[i] = XXH3-64(token ids of page i as u32 little-endian, seed)
    hash[i]  = XXH3-64(hash[i-1] as u64 LE || local[i] as u64 LE, seed),   hash[-1] = 0

Only full pages are hashed. Known-answer vectors: ``tests/vectors/page_hash.json``.

Speed: the per-page ``local`` hashes are independent, so XXH3-64 is evaluated here with numpy,
vectorised across pages, for every input length up to 1,024 bytes (page sizes 1..256; the
4-8, 9-16, 17-128, 129-240 and single-block long paths of the reference). The chain is
sequential by definition; it runs as a compiled loop when ``numba`` is importable and as one
``xxhash`` call per page otherwise. Both paths are checked against the ``xxhash`` library.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import xxhash

__all__ = [
    "chain_page_hashes",
    "local_page_hashes",
    "page_hashes",
    "page_hashes_reference",
    "tokens_to_u32le",
]

_U64 = np.uint64
_M64 = (1 << 64) - 1
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P64_4, _P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
_PMX1, _PMX2 = 0x165667919E3779F9, 0x9FB21C651E98DF25
_KSECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_U32LE = np.dtype("<u4")
_SCRATCH_TOKENS = 1 << 22  # a thread's token scratch grows to this (16 MiB), larger prompts convert fresh
_scratch = threading.local()
_MAX_VECTOR_BYTES = 1024  # one XXH3 block: stripes accumulate without a scramble step


def tokens_to_u32le(tokens: Sequence[int] | np.ndarray | bytes) -> bytes:
    """Token ids as packed u32 little-endian bytes (the wire form of TokenIds)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        return bytes(tokens)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in u32")
    if arr.dtype == _U32LE or not _SCRATCH_TOKENS >= arr.size > 0:
        return arr.astype(_U32LE, copy=False).tobytes()
    # NOTE: converted in this thread's scratch, not a fresh array: a fresh 0.5 MiB array and the
    # 0.5 MiB bytes after it are both new pages each call (glibc maps them: ~0.55 ms of page faults
    # for 131,072 tokens on the 2-core VM, against 0.045 ms this way)
    scratch = getattr(_scratch, "u32", None)
    if scratch is None or scratch.size < arr.size:
        scratch = _scratch.u32 = np.empty(max(arr.size, 1 << 16), dtype=_U32LE)
    view = scratch[: arr.size]
    np.copyto(view, arr, casting="unsafe")
    return view.tobytes()


def page_hashes_reference(
    tokens: Sequence[int] | np.ndarray | bytes, page_size: int, seed: int = 0
) -> np.ndarray:
    """The definition, one ``xxhash`` call per hash; slow, kept as the oracle for tests."""
    data, n, step = _pages(tokens, page_size, seed)
    out = np.empty(n, dtype=np.uint64)
    h, prev = xxhash.xxh3_64_intdigest, 0
    for i in range(n):
        local = h(data[i * step : (i + 1) * step], seed)
        prev = h((prev | (local << 64)).to_bytes(16, "little"), seed)
        out[i] = prev
    return out


def page_hashes(
    tokens: Sequence[int] | np.ndarray | bytes, page_size: int, seed: int = 0, *, parent: int = 0
) -> np.ndarray:
    """Chained hashes of every full page, as a uint64 array of length len(tokens) // page_size.

    ``parent`` is ``hash[-1]``: pass the hash of the page before ``tokens`` to continue a chain.
    """
    if not 0 <= parent <= _M64:
        raise ValueError("parent must fit in u64")
    return chain_page_hashes(local_page_hashes(tokens, page_size, seed), seed, parent=parent)


def local_page_hashes(
    tokens: Sequence[int] | np.ndarray | bytes, page_size: int, seed: int = 0
) -> np.ndarray:
    """``local[i]`` of every full page (the parallel half of the scheme), as uint64.

    Callers with many independent chains (e.g. a batch of KV events) hash all their pages in
    one call and chain each slice with :func:`chain_page_hashes`.
    """
    data, n, step = _pages(tokens, page_size, seed)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    if step <= _MAX_VECTOR_BYTES:
        words = np.frombuffer(data, dtype="<u4", count=n * page_size).reshape(n, page_size)
        return _xxh3_pages(words, seed)
    h = xxhash.xxh3_64_intdigest
    return np.fromiter((h(data[i * step : (i + 1) * step], seed) for i in range(n)), np.uint64, n)


def chain_page_hashes(local: np.ndarray, seed: int = 0, *, parent: int = 0) -> np.ndarray:
    """The chained hashes of ``local`` page hashes continuing from ``parent`` (the sequential half)."""
    if local.size == 0:
        return np.empty(0, dtype=np.uint64)
    return _chain(np.ascontiguousarray(local, dtype=np.uint64), seed, parent)


def _pages(tokens: Sequence[int] | np.ndarray | bytes, page_size: int, seed: int) -> tuple[bytes, int, int]:
    if page_size <= 0:
        raise ValueError("page_size must be > 0")
    if not 0 <= seed <= _M64:
        raise ValueError("seed must fit in u64")
    data = tokens_to_u32le(tokens)
    if len(data) % 4:
        raise ValueError("token bytes must be a multiple of 4 (u32 little-endian)")
    return data, len(data) // (page_size * 4), page_size * 4


# --- the chain: sequential, 16-byte XXH3 inputs -----------------------------------------------


def _chain_xxhash(local: np.ndarray, seed: int, parent: int = 0) -> np.ndarray:
    h = xxhash.xxh3_64_intdigest
    shifted = [v << 64 for v in local.tolist()]
    out = accumulate(shifted, lambda prev, hi: h((prev | hi).to_bytes(16, "little"), seed), initial=parent)
    it = iter(out)
    next(it)
    return np.fromiter(it, np.uint64, len(shifted))


def _load_numba_chain() -> Any:
    try:
        from ._hash_chain_numba import chain
    except ImportError:  # numba is optional for clients; the xxhash loop is the fallback
        return None
    return chain


_numba_chain: Any = None
_numba_tried = False


def _chain(local: np.ndarray, seed: int, parent: int = 0) -> np.ndarray:
    global _numba_chain, _numba_tried
    if not _numba_tried:
        _numba_chain, _numba_tried = _load_numba_chain(), True
    if _numba_chain is None:
        return _chain_xxhash(local, seed, parent)
    out: np.ndarray = _numba_chain(local, _U64(seed), _K34, _K56, _U64(parent))
    return out


# --- vectorised XXH3-64 over equal-length inputs (one row per page) ---------------------------


def _secret_words(secret: bytes) -> list[int]:
    """readLE64(secret + 8 * i) for every i (offsets that are not multiples of 8 use _rd)."""
    return [int.from_bytes(secret[o : o + 8], "little") for o in range(0, len(secret) - 7, 8)]


_KW = _secret_words(_KSECRET)
_K34, _K56 = _U64(_KW[3] ^ _KW[4]), _U64(_KW[5] ^ _KW[6])  # the chain's 16-byte-input secret words


def _rd(secret: bytes, off: int) -> int:
    return int.from_bytes(secret[off : off + 8], "little")


def _mul128_fold64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a * b) as 128 bits, low half XOR high half; 32-bit limbs since numpy has no u128."""
    m32 = _U64(0xFFFFFFFF)
    a_lo, a_hi, b_lo, b_hi = a & m32, a >> _U64(32), b & m32, b >> _U64(32)
    lo_lo, hi_lo, lo_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi
    cross = (lo_lo >> _U64(32)) + (hi_lo & m32) + lo_hi
    upper = (hi_lo >> _U64(32)) + (cross >> _U64(32)) + a_hi * b_hi
    return (a * b) ^ upper


def _avalanche(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> _U64(37))
    h = h * _U64(_PMX1)
    return h ^ (h >> _U64(32))


def _u64_at(words: np.ndarray, byte_off: int) -> np.ndarray:
    """Little-endian u64 at a byte offset (a multiple of 4) of every row."""
    i = byte_off // 4
    if i % 2 == 0 and words.shape[1] % 2 == 0 and words.flags.c_contiguous:
        return words.view("<u8")[:, i // 2]  # aligned: no widening needed
    return words[:, i].astype(_U64) | (words[:, i + 1].astype(_U64) << _U64(32))


def _mix16(words: np.ndarray, off: int, secret: bytes, soff: int, seed: int) -> np.ndarray:
    lo = _u64_at(words, off) ^ _U64((_rd(secret, soff) + seed) & _M64)
    hi = _u64_at(words, off + 8) ^ _U64((_rd(secret, soff + 8) - seed) & _M64)
    return _mul128_fold64(lo, hi)


def _xxh3_pages(words: np.ndarray, seed: int) -> np.ndarray:
    """XXH3-64 of each row of ``words`` (u32 tokens, 4..1,024 bytes per row), vectorised."""
    n, length = words.shape[0], 4 * words.shape[1]
    s = _KSECRET
    if length <= 8:
        seed2 = seed ^ (int.from_bytes((seed & 0xFFFFFFFF).to_bytes(4, "little"), "big") << 32)
        bitflip = _U64(((_rd(s, 8) ^ _rd(s, 16)) - seed2) & _M64)
        x: np.ndarray = (words[:, -1].astype(_U64) + (words[:, 0].astype(_U64) << _U64(32))) ^ bitflip
        x = x ^ ((x << _U64(49)) | (x >> _U64(15))) ^ ((x << _U64(24)) | (x >> _U64(40)))
        x = x * _U64(_PMX2)
        x = x ^ ((x >> _U64(35)) + _U64(length))
        x = x * _U64(_PMX2)
        return x ^ (x >> _U64(28))
    if length <= 16:
        lo = _u64_at(words, 0) ^ _U64(((_rd(s, 24) ^ _rd(s, 32)) + seed) & _M64)
        hi = _u64_at(words, length - 8) ^ _U64(((_rd(s, 40) ^ _rd(s, 48)) - seed) & _M64)
        return _avalanche(_U64(length) + lo.byteswap() + hi + _mul128_fold64(lo, hi))
    acc = np.full(n, (length * _P64_1) & _M64, dtype=_U64)
    if length <= 128:
        for k in range((length - 1) // 32, -1, -1):  # pairs from the middle outwards, as the reference
            acc += _mix16(words, 16 * k, s, 32 * k, seed)
            acc += _mix16(words, length - 16 * (k + 1), s, 32 * k + 16, seed)
        return _avalanche(acc)
    if length <= 240:
        for i in range(8):
            acc += _mix16(words, 16 * i, s, 16 * i, seed)
        acc = _avalanche(acc)
        for i in range(8, length // 16):
            acc += _mix16(words, 16 * i, s, 16 * (i - 8) + 3, seed)
        acc += _mix16(words, length - 16, s, 136 - 17, seed)
        return _avalanche(acc)
    return _xxh3_long_one_block(words, length, seed)


def _xxh3_long_one_block(words: np.ndarray, length: int, seed: int) -> np.ndarray:
    ks = _secret_words(_KSECRET)
    secret = b"".join(
        (
            ((ks[2 * i] + seed) & _M64).to_bytes(8, "little")
            + ((ks[2 * i + 1] - seed) & _M64).to_bytes(8, "little")
        )
        for i in range(12)
    )
    n = words.shape[0]
    init = [_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1]
    acc = [np.full(n, v, dtype=_U64) for v in init]
    m32 = _U64(0xFFFFFFFF)
    stripes = [(64 * k, 8 * k) for k in range((length - 1) // 64)] + [(length - 64, 192 - 64 - 7)]
    for in_off, s_off in stripes:
        for i in range(8):
            val = _u64_at(words, in_off + 8 * i)
            key = val ^ _U64(_rd(secret, s_off + 8 * i))
            acc[i ^ 1] += val
            acc[i] += (key & m32) * (key >> _U64(32))
    result = np.full(n, (length * _P64_1) & _M64, dtype=_U64)
    for i in range(4):
        result += _mul128_fold64(
            acc[2 * i] ^ _U64(_rd(secret, 11 + 16 * i)), acc[2 * i + 1] ^ _U64(_rd(secret, 19 + 16 * i))
        )
    return _avalanche(result)
