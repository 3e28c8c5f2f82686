"""Pack/unpack of host pools with the compiled CPU copy loop (``_fused_cpu``): one pass, no temporary.

The staging layout (``_regions``) is itself a set of "regions": the segment of slice ``s`` and
pool region ``r`` holds ``n`` pages of ``page_size`` rows of ``h`` heads. So a pack is a fused
page copy from every pool region into its staging segments (pages ``0..n-1``), and an unpack the
same copy the other way, each (slice, region) pair one row of the loop's address tables::

    pool side     base[r] + pages[i]*(P*H*hb) + t*(H*hb) + (head_start + s*h)*hb
    staging side  staging + s*slice_bytes + seg[r] + i*(P*h*hb) + t*(h*hb)
    row           h*hb bytes (a whole page in one copy when h = H)

The torch reference moves the same bytes with ``index_select`` into a temporary and then a copy
(two passes plus the temporary's page faults); this is the CPU path of ``kernels.pack/unpack``,
the reference stays their oracle. The caller checked the call (``check_copy``).
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from . import _fused_cpu
from ._checks import CopyArgs
from ._regions import KVRegions

__all__ = ["pack", "unpack"]


def _tables(
    regions: KVRegions, args: CopyArgs
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per (slice, region): pool base, staging base, pool-side and staging-side geometry
    ``[page, token, offset]`` in bytes, and row bytes."""
    if regions.device.type != "cpu" or args.staging.device.type != "cpu":
        raise InvalidArgument("backend", "'cpu' copies host regions and host staging only")
    n, h, s_count, ps = args.pages.numel(), args.num_heads, args.num_slices, regions.page_size
    hb = regions.region_head_bytes  # [R]
    seg = n * ps * h * hb
    seg_off = np.concatenate(([0], np.cumsum(seg)[:-1]))
    s = np.arange(s_count, dtype=np.int64)[:, None]
    pool_base = np.tile(regions.base_addresses, s_count)
    stg_base = (args.staging.data_ptr() + s * int(seg.sum()) + seg_off[None, :]).reshape(-1)
    head_off = ((args.head_start + s * h) * hb[None, :]).reshape(-1)
    hb_all = np.tile(hb, s_count)
    pool_geom = np.stack([ps * regions.num_heads * hb_all, regions.num_heads * hb_all, head_off], axis=1)
    stg_geom = np.stack([ps * h * hb_all, h * hb_all, np.zeros_like(hb_all)], axis=1)
    return pool_base, stg_base, pool_geom, stg_geom, h * hb_all


def _copy(regions: KVRegions, args: CopyArgs, to_staging: bool) -> None:
    n = args.pages.numel()
    if not n:
        return
    pool_base, stg_base, pool_geom, stg_geom, rows = _tables(regions, args)
    pool = (pool_base, args.pages.numpy(), pool_geom)
    staged = (stg_base, np.arange(n, dtype=np.int64), stg_geom)
    (sb, sp, sg), (db, dp, dg) = (pool, staged) if to_staging else (staged, pool)
    _fused_cpu.copy_regions(sb, db, sp, dp, np.concatenate([sg, dg], axis=1), rows, regions.page_size)


def pack(regions: KVRegions, args: CopyArgs) -> None:
    """Gather ``args.pages`` of every region (head slices) into ``args.staging``."""
    _copy(regions, args, to_staging=True)


def unpack(regions: KVRegions, args: CopyArgs) -> None:
    """Scatter ``args.staging`` into the (distinct) ``args.pages`` at the call's head slices."""
    _copy(regions, args, to_staging=False)
