"""Page layouts read independently of the service: a pool's pages as each head's K and V rows per
token, ``[layer][pages, page_size, heads, bytes]``, from the layouts' definitions (the SDK's
``Layout`` docstring), for byte checks of page-layout conversions."""

from __future__ import annotations

import numpy as np
from kvservice_client import Layout

__all__ = ["heads_kv"]


def heads_kv(
    regions: list[np.ndarray], pages: list[int], lay: Layout
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """K and V of ``pages`` per layer, each ``[len(pages), page_size, local heads, row bytes]``
    (``regions``: the pool's regions as ``[num_pages, page_bytes]`` uint8, K layers then V)."""
    n, ps, h = len(pages), lay.page_size, lay.local_kv_heads
    dk, dv = lay.head_dim_k * lay.itemsize, lay.head_dim_v * lay.itemsize
    ks, vs = [], []
    for layer in range(lay.num_layers):
        page = regions[layer][pages]  # [n, page bytes]
        other = regions[lay.num_layers + layer][pages] if lay.num_v_regions else None
        pl = lay.page_layout
        if pl == "nhd":
            k, v = page.reshape(n, ps, h, dk), other.reshape(n, ps, h, dv)  # type: ignore[union-attr]
        elif pl == "hnd":
            k = page.reshape(n, h, ps, dk).transpose(0, 2, 1, 3)
            v = other.reshape(n, h, ps, dv).transpose(0, 2, 1, 3)  # type: ignore[union-attr]
        elif pl == "nhc":
            row = page.reshape(n, ps, h, dk + dv)
            k, v = row[..., :dk], row[..., dk:]
        elif pl == "hnc":
            row = page.reshape(n, h, ps, dk + dv).transpose(0, 2, 1, 3)
            k, v = row[..., :dk], row[..., dk:]
        elif pl == "kv_nhd":
            k = page[:, : ps * h * dk].reshape(n, ps, h, dk)
            v = page[:, ps * h * dk :].reshape(n, ps, h, dv)
        elif pl == "kv_hnd":
            k = page[:, : ps * h * dk].reshape(n, h, ps, dk).transpose(0, 2, 1, 3)
            v = page[:, ps * h * dk :].reshape(n, h, ps, dv).transpose(0, 2, 1, 3)
        elif pl == "hnd_kv":
            per_head = page.reshape(n, h, ps * (dk + dv))
            k = per_head[..., : ps * dk].reshape(n, h, ps, dk).transpose(0, 2, 1, 3)
            v = per_head[..., ps * dk :].reshape(n, h, ps, dv).transpose(0, 2, 1, 3)
        else:
            raise ValueError(pl)
        ks.append(np.ascontiguousarray(k))
        vs.append(np.ascontiguousarray(v))
    return ks, vs
