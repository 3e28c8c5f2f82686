"""What the lane compares between two pools: a layout's signature (equal layouts: whole pages),
its heads (head slices between TP sizes: docs/decisions/0014, "Mixed TP on the lane"), its
signature but for the page size (page-size conversions: docs/decisions/0027) and where each head's
K and V rows lie in a page (page-layout conversions: docs/decisions/0029)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvservice_client import Layout

__all__ = ["head_geometry", "heads_overlap", "layout_signature", "row_table", "unit_signature"]

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


def row_table(layout: Layout) -> tuple[int, npt.NDArray[np.uint64]]:
    """Where each head's K and V rows lie in a page of ``layout``, for conversions between page
    layouts (vLLM's ``nhc`` and SGLang's ``nhd``, ``hnd``, FlashInfer's ``kv_nhd``, ...): the
    signature of the layout but for its page layout (0: MLA, one layout only), and one row per
    (layer, K then V, local head), in that order on every layout: (region, byte offset of the
    head's first token in the page, bytes from one token to the next, bytes of the head's row).

        nhd  K region l: [page_size][heads][dk]     head h: offset h*dk,   token stride heads*dk
        nhc  region l:   [page_size][heads][dk|dv]  K of h: offset h*(dk+dv), stride heads*(dk+dv)
        hnd  K region l: [heads][page_size][dk]     head h: offset h*ps*dk, token stride dk
    """
    return _row_table(layout)


@functools.lru_cache(maxsize=256)  # NOTE: a pure function of a frozen Layout
def _row_table(layout: Layout) -> tuple[int, npt.NDArray[np.uint64]]:
    if layout.kind != "mha":
        return 0, np.zeros((0, 4), dtype=np.uint64)
    sig = _signature(dataclasses.replace(layout, num_pages=0, tp_rank=0, page_layout="nhd"))
    nl, h, ps, b = layout.num_layers, layout.local_kv_heads, layout.page_size, layout.itemsize
    dk, dv = layout.head_dim_k * b, layout.head_dim_v * b
    heads = np.arange(h, dtype=np.int64)
    one = layout.num_v_regions == 0  # K and V in one region a layer
    # per page layout: (K offset of head h, K token stride, V offset of head h, V token stride)
    geo = {
        "nhd": (heads * dk, h * dk, heads * dv, h * dv),
        "hnd": (heads * ps * dk, dk, heads * ps * dv, dv),
        "nhc": (heads * (dk + dv), h * (dk + dv), heads * (dk + dv) + dk, h * (dk + dv)),
        "hnc": (heads * ps * (dk + dv), dk + dv, heads * ps * (dk + dv) + dk, dk + dv),
        "kv_nhd": (heads * dk, h * dk, ps * h * dk + heads * dv, h * dv),
        "kv_hnd": (heads * ps * dk, dk, ps * h * dk + heads * ps * dv, dv),
        "hnd_kv": (heads * ps * (dk + dv), dk, heads * ps * (dk + dv) + ps * dk, dv),
    }.get(layout.page_layout)
    if geo is None:
        return 0, np.zeros((0, 4), dtype=np.uint64)
    k_off, k_tok, v_off, v_tok = geo
    rows = []
    for layer in range(nl):
        k_region, v_region = layer, layer if one else nl + layer
        rows.append(np.stack([np.full(h, k_region), k_off, np.full(h, k_tok), np.full(h, dk)], axis=1))
        rows.append(np.stack([np.full(h, v_region), v_off, np.full(h, v_tok), np.full(h, dv)], axis=1))
    return sig, np.ascontiguousarray(np.concatenate(rows), dtype=np.uint64)


def _signature(layout: Layout) -> int:
    return int.from_bytes(hashlib.blake2b(repr(layout).encode(), digest_size=8).digest(), "little")
