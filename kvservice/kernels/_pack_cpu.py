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


def _tables(regions: KVRegions, args: CopyArgs) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per (slice, region): pool base, staging base, pool-side and staging-side geometry
    ``[page, token, offset]`` in bytes, and row bytes."""
    if regions.device.type != "cpu" or args.staging.device.type != "cpu":
        raise InvalidArgument("backend", "'cpu' copies host regions and host staging only")
    n, h, s_count, ps = args.pages.numel(), args.num_heads, args.num_slices, regions.page_size
    hb = regions.region_head_bytes  # [R]
    seg = n * ps * h * hb
    seg_off = np.concatenate(([0], np.cumsum(seg)[:-1]))
    slice_bytes = int(seg.sum())
    s = np.arange(s_count, dtype=np.int64)[:, None]
    pool_base = np.tile(regions.base_addresses, s_count)
    stg_base = (args.staging.data_ptr() + s * slice_bytes + seg_off[None, :]).reshape(-1)
    head_off = ((args.head_start + s * h) * hb[None, :]).reshape(-1)
    hb_all = np.tile(hb, s_count)
    pool_geom = np.stack([ps * regions.num_heads * hb_all, regions.num_heads * hb_all, head_off], axis=1)
    stg_geom = np.stack([ps * h * hb_all, h * hb_all, np.zeros_like(hb_all)], axis=1)
    return pool_base, stg_base, np.concatenate([pool_geom, stg_geom], axis=1), h * hb_all


def pack(regions: KVRegions, args: CopyArgs) -> None:
    """Gather ``args.pages`` of every region (head slices) into ``args.staging``."""
    n = args.pages.numel()
    if not n:
        return
    pool_base, stg_base, geom, rows = _tables(regions, args)
    pages = args.pages.numpy()
    _fused_cpu.copy_regions(
        pool_base, stg_base, pages, np.arange(n, dtype=np.int64), geom, rows, regions.page_size
    )


def unpack(regions: KVRegions, args: CopyArgs) -> None:
    """Scatter ``args.staging`` into the (distinct) ``args.pages`` at the call's head slices."""
    n = args.pages.numel()
    if not n:
        return
    pool_base, stg_base, geom, rows = _tables(regions, args)
    swapped = np.ascontiguousarray(geom[:, [3, 4, 5, 0, 1, 2]])  # staging is the source now
    pages = args.pages.numpy()
    _fused_cpu.copy_regions(
        stg_base, pool_base, np.arange(n, dtype=np.int64), pages, swapped, rows, regions.page_size
    )
