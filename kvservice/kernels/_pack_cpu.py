"""Pack/unpack of host pools with the compiled CPU copy loop (``_fused_cpu``): one pass, no temporary.

The staging layout (``_regions``) is itself a set of "regions": the segment of slice ``s`` and
pool region ``r`` holds ``n`` units of ``g`` tokens x ``h`` heads. So a pack is a fused unit copy
from every pool region into its staging segments (units ``0..n-1``), and an unpack the same copy
the other way, each (slice, region) pair one row of the loop's address tables::

    pool side     base[r] + (u // m)*page + (u % m)*g*token + (head_start + s*h)*head   (+ runs)
    staging side  staging + s*slice_bytes + seg[r] + i*(g*h*hb)                           (+ runs)
    runs          ``copy_loops``: a whole unit when the pool's page is ordered like the staging

The torch reference moves the same bytes with advanced indexing into a temporary and then a copy
(two passes plus the temporary's page faults); this is the CPU path of ``kernels.pack/unpack``,
the reference stays their oracle. The caller checked the call (``check_copy``).
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from . import _fused_cpu
from ._checks import CopyArgs
from ._regions import KVRegions, copy_loops, staging_strides

__all__ = ["pack", "unpack"]


def _tables(regions: KVRegions, args: CopyArgs) -> tuple[np.ndarray, ...]:
    """Per (slice, region): pool base, staging base, pool-side and staging-side geometry
    ``[page, unit, outer, inner, head offset]`` in bytes, and the loop dims."""
    if regions.device.type != "cpu" or args.staging.device.type != "cpu":
        raise InvalidArgument("backend", "'cpu' copies host regions and host staging only")
    n, h, s_count, g = args.pages.numel(), args.num_heads, args.num_slices, args.unit
    hbs = [regions.head_bytes_k, regions.head_bytes_v] if regions.v else [regions.head_bytes_k]
    pool_kind, stg_kind, dims_kind, head_kind = [], [], [], []
    for hb in hbs:
        page, token, head = regions.strides(hb)
        loops = copy_loops(
            g, h, hb, (token, head), staging_strides(g, h, hb, args.head_major), args.head_major
        )
        pool_kind.append([page, g * token, *loops.src, 0])
        stg_kind.append([g * h * hb, 0, *loops.dst, 0])
        dims_kind.append([loops.outer_count, loops.inner_count, loops.row])
        head_kind.append(head)
    layers = regions.num_layers
    hb_all = np.tile(np.array(hbs, dtype=np.int64), layers)  # [R] staging order
    seg = n * g * h * hb_all
    seg_off = np.concatenate(([0], np.cumsum(seg)[:-1]))
    s = np.arange(s_count, dtype=np.int64)[:, None]
    pool_geom = np.tile(np.array(pool_kind, dtype=np.int64), (s_count * layers, 1))
    pool_geom[:, 4] = (
        (args.head_start + s * h) * np.tile(np.array(head_kind, dtype=np.int64), layers)
    ).reshape(-1)
    stg_geom = np.tile(np.array(stg_kind, dtype=np.int64), (s_count * layers, 1))
    dims = np.tile(np.array(dims_kind, dtype=np.int64), (s_count * layers, 1))
    pool_base = np.tile(regions.base_addresses, s_count)
    stg_base = (args.staging.data_ptr() + s * int(seg.sum()) + seg_off[None, :]).reshape(-1)
    return pool_base, stg_base, pool_geom, stg_geom, dims


def _copy(regions: KVRegions, args: CopyArgs, to_staging: bool) -> None:
    n = args.pages.numel()
    if not n:
        return
    pool_base, stg_base, pool_geom, stg_geom, dims = _tables(regions, args)
    pool = (pool_base, args.pages.numpy(), pool_geom, args.units_per_page(regions))
    staged = (stg_base, np.arange(n, dtype=np.int64), stg_geom, 1)
    (sb, sp, sg, sm), (db, dp, dg, dm) = (pool, staged) if to_staging else (staged, pool)
    _fused_cpu.copy_regions(sb, db, sp, dp, np.concatenate([sg, dg], axis=1), dims, sm, dm)


def pack(regions: KVRegions, args: CopyArgs) -> None:
    """Gather ``args.pages`` of every region (head slices) into ``args.staging``."""
    _copy(regions, args, to_staging=True)


def unpack(regions: KVRegions, args: CopyArgs) -> None:
    """Scatter ``args.staging`` into the (distinct) ``args.pages`` at the call's head slices."""
    _copy(regions, args, to_staging=False)
