"""Shared-memory KV pools in tests: random fills, snapshots and byte checks.

Pools are filled with random bytes (destination pools too, so a write outside the named pages
shows as a changed canary page). Head-sliced checks view a pool's raw page bytes as::

    [num_pages, page_size, local_heads, head_dim * itemsize]      (MHA, NHD per page)

and compare against a "global" pool holding every head, from which each TP rank's pool was cut
(``fill_tp``). ``make_pool`` is the fixture factory (tests/support/fixtures.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from kvservice_client import Layout, ShmKVPool

__all__ = [
    "assert_pages_equal",
    "assert_tp_pages",
    "assert_unchanged",
    "fill_random",
    "fill_tp",
    "global_kv",
    "heads_view",
    "rank_heads",
    "regions_of",
    "snapshot",
]


def regions_of(pool: ShmKVPool) -> list[np.ndarray]:
    """Every KV region view ``[num_pages, page_bytes]`` (K layers, then V layers)."""
    lay = pool.layout
    return [pool.k(i) for i in range(lay.num_layers)] + [pool.v(i) for i in range(lay.num_v_regions)]


def fill_random(pool: ShmKVPool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for r in regions_of(pool):
        r[:] = rng.integers(0, 256, r.shape, dtype=np.uint8)
    for name in getattr(pool, "_aux", {}):
        a = pool.aux(name)
        a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)


def snapshot(pool: ShmKVPool) -> list[np.ndarray]:
    snap = [r.copy() for r in regions_of(pool)]
    snap += [pool.aux(n).copy() for n in getattr(pool, "_aux", {})]
    return snap


def assert_unchanged(pool: ShmKVPool, snap: list[np.ndarray], except_pages: Sequence[int] = ()) -> None:
    """Every page outside ``except_pages`` (and every aux row) equals the snapshot."""
    now = snapshot(pool)
    keep = np.ones(pool.layout.num_pages, dtype=bool)
    keep[np.asarray(except_pages, dtype=np.int64)] = False
    nkv = len(regions_of(pool))
    for i, (a, b) in enumerate(zip(now, snap, strict=True)):
        if i < nkv:
            bad = np.flatnonzero(keep & (a != b).any(axis=1))
            assert bad.size == 0, f"region {i}: pages {bad.tolist()} changed outside the named pages"
        else:
            assert np.array_equal(a, b), "aux rows changed"


def assert_pages_equal(
    dst: ShmKVPool, dst_pages: Sequence[int], src: ShmKVPool, src_pages: Sequence[int]
) -> None:
    d, s = np.asarray(dst_pages, dtype=np.int64), np.asarray(src_pages, dtype=np.int64)
    assert d.size == s.size
    for i, (a, b) in enumerate(zip(regions_of(dst), regions_of(src), strict=True)):
        diff = np.flatnonzero((a[d] != b[s]).any(axis=1))
        assert diff.size == 0, f"region {i}: dst pages {d[diff].tolist()} differ from src {s[diff].tolist()}"


def heads_view(region: np.ndarray, lay: Layout, v: bool = False) -> np.ndarray:
    hd = (lay.head_dim_v if v else lay.head_dim_k) * lay.itemsize
    return region.reshape(lay.num_pages, lay.page_size, lay.local_kv_heads, hd)


def rank_heads(total: int, tp: int, rank: int) -> np.ndarray:
    """Global heads held by ``rank`` (SGLang split; one replicated head when tp > total)."""
    if tp <= total:
        n = total // tp
        return np.arange(rank * n, (rank + 1) * n)
    return np.array([rank * total // tp])


def global_kv(lay: Layout, seed: int) -> list[np.ndarray]:
    """Random 'all heads' KV: per region ``[num_pages, page_size, H, head_dim*itemsize]``."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(lay.num_layers * (2 if lay.kind == "mha" else 1)):
        hd = (lay.head_dim_v if i >= lay.num_layers else lay.head_dim_k) * lay.itemsize
        out.append(
            rng.integers(0, 256, (lay.num_pages, lay.page_size, lay.total_kv_heads, hd), dtype=np.uint8)
        )
    return out


def fill_tp(pool: ShmKVPool, glob: list[np.ndarray]) -> None:
    """Cut this rank's heads out of the global KV into its pool."""
    lay = pool.layout
    heads = rank_heads(lay.total_kv_heads, lay.tp_size, lay.tp_rank)
    for i, r in enumerate(regions_of(pool)):
        heads_view(r, lay, v=i >= lay.num_layers)[:] = glob[i][:, :, heads, :]


def assert_tp_pages(
    pool: ShmKVPool, dst_pages: Sequence[int], glob: list[np.ndarray], src_pages: Sequence[int]
) -> None:
    """Receiver rank's ``dst_pages`` hold exactly its heads of the global ``src_pages``."""
    lay = pool.layout
    heads = rank_heads(lay.total_kv_heads, lay.tp_size, lay.tp_rank)
    d, s = np.asarray(dst_pages), np.asarray(src_pages)
    for i, r in enumerate(regions_of(pool)):
        got = heads_view(r, lay, v=i >= lay.num_layers)[d]
        want = glob[i][s][:, :, heads, :]
        for h in range(len(heads)):
            assert np.array_equal(got[:, :, h], want[:, :, h]), (
                f"rank {lay.tp_rank}/{lay.tp_size} region {i}: local head {h} (global {heads[h]}) wrong"
            )
