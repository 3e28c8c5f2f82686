"""What the lane compares between two pools: a layout's signature (equal layouts: whole pages),
its heads (head slices between TP sizes: docs/decisions/0014, "Mixed TP on the lane") and its
signature but for the page size (page-size conversions: docs/decisions/0027)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvservice_client import Layout

__all__ = ["head_geometry", "heads_overlap", "layout_signature", "unit_signature"]

# page layouts whose region pages hold their tokens' rows in token order (a run of g tokens is
# g rows): K and V regions apart (nhd, and MLA's latent) or K|V side by side in each row (nhc)
_TOKEN_MAJOR = ("nhd", "nhc")


def layout_signature(layout: Layout) -> int:
    """What two pools must share for a page-for-page copy (all but the pool size and the rank)."""
    return _signature(dataclasses.replace(layout, num_pages=0, tp_rank=0))


def unit_signature(layout: Layout) -> int:
    """What two pools of different page sizes must share for the lane to copy units of
    gcd(page sizes) tokens between them (0: the layout cannot: head-major pages, or K and V
    apart within a page)."""
    if layout.page_layout not in _TOKEN_MAJOR:
        return 0
    return _signature(dataclasses.replace(layout, num_pages=0, tp_rank=0, page_size=0))


@functools.lru_cache(maxsize=1024)  # NOTE: a pure function of a frozen Layout, asked per declaration
def head_geometry(layout: Layout) -> tuple[int, int, int, int, int]:
    """What the lane needs for head slices between TP sizes: (mode, signature of the layout but
    for its TP, first global head, local heads, page size). Mode 1: token-major pages ("nhd"),
    2: head-major ("hnd"), 0: none (K and V in one region, MLA, replicated heads: gRPC)."""
    mode = {"nhd": 1, "hnd": 2}.get(layout.page_layout, 0)
    if layout.kind != "mha" or layout.tp_size > layout.total_kv_heads:
        mode = 0
    but_tp = dataclasses.replace(layout, num_pages=0, tp_rank=0, tp_size=1, local_kv_heads=0, dp_rank=0)
    sig = _signature(but_tp)
    local = layout.local_kv_heads
    return mode, sig, layout.tp_rank * local, local, layout.page_size


def heads_overlap(src: Layout, dst: Layout) -> bool:
    """Whether a sender of layout ``src`` may write a receiver rank of layout ``dst`` (True when
    the two cannot be told apart by heads: another page layout, replicated heads, MLA)."""
    a, b = head_geometry(src), head_geometry(dst)
    if a[0] == 0 or a[0] != b[0] or a[1] != b[1]:
        return True
    return max(a[2], b[2]) < min(a[2] + a[3], b[2] + b[3])


def _signature(layout: Layout) -> int:
    return int.from_bytes(hashlib.blake2b(repr(layout).encode(), digest_size=8).digest(), "little")
