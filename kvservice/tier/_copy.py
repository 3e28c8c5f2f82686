"""Copies between an engine's registered pages and the tier's slots, one region at a time.

A tier page is the buffer set's regions' bytes of that page, in wire order (``BufferSet.regions``:
K or latent of every layer, then V of every layer)::

    engine region r   [num_pages, rb_r]         page p is row p
    tier slot s       [ r0: rb_0 | r1: rb_1 | ... ]   columns off_r .. off_r + rb_r

Each direction is one gather and one scatter per region per batch (numpy fancy indexing on host
pools; torch indexing and one device copy per region on GPU pools), never a loop per page.
"""

from __future__ import annotations

import numpy as np
import torch

from ..buffers import BufferSet

__all__ = ["from_tier", "to_tier"]


def _columns(bs: BufferSet) -> list[tuple[int, int]]:
    """(offset, bytes) of each region's page inside a tier page."""
    out, off = [], 0
    for r in bs.regions:
        rb = r.size // bs.layout.num_pages
        out.append((off, rb))
        off += rb
    return out


def to_tier(bs: BufferSet, pages: np.ndarray, arena: np.ndarray, slots: np.ndarray) -> None:
    """``arena[slots[i]] = page pages[i] of bs`` (whole pages)."""
    if not pages.size:
        return
    index = None
    for region, (off, rb) in zip(bs.regions, _columns(bs), strict=True):
        src = region.pages(rb)
        if src.device.type == "cpu":
            arena[slots, off : off + rb] = src.numpy()[pages]
        else:
            if index is None:
                index = torch.from_numpy(pages).to(src.device)
            arena[slots, off : off + rb] = src.index_select(0, index).cpu().numpy()


def from_tier(bs: BufferSet, pages: np.ndarray, arena: np.ndarray, slots: np.ndarray) -> None:
    """``page pages[i] of bs = arena[slots[i]]`` (whole pages)."""
    if not pages.size:
        return
    index = None
    for region, (off, rb) in zip(bs.regions, _columns(bs), strict=True):
        dst = region.pages(rb)
        if dst.device.type == "cpu":
            dst.numpy()[pages] = arena[slots, off : off + rb]
        else:
            if index is None:
                index = torch.from_numpy(pages).to(dst.device)
            rows = torch.from_numpy(np.ascontiguousarray(arena[slots, off : off + rb]))
            dst.index_copy_(0, index, rows.to(dst.device, non_blocking=False))
    if bs.regions and bs.regions[0].tensor.device.type != "cpu":
        torch.cuda.synchronize(bs.regions[0].tensor.device)
