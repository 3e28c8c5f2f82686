"""Fused page-to-page copy between two KV pools of one node: no staging, one pass over the bytes.

``copy_pages(src, dst, src_pages, dst_pages, ...)`` writes, for every layer's K and V (MHA) or
latent (MLA), the heads ``[src_head_start, +num_heads)`` of source page ``src_pages[i]`` into
heads ``[dst_head_start, +num_heads)`` of destination page ``dst_pages[i]``::

    src region  [num_pages][page_size][src heads][head_bytes]     (src.num_heads = H / sender TP)
    dst region  [num_pages][page_size][dst heads][head_bytes]     (dst.num_heads = H / receiver TP)
    token row:  src[sp, t, hs:hs+h]  ──▶  dst[dp, t, hd:hd+h]      for every region, page, token

With ``unit`` (tokens dividing both page sizes) the page lists are unit lists (``_regions``), so
pools of different page sizes exchange tokens; either side may order its pages token-major
(``nhd``) or head-major (``hnd``, ``hnd_kv``): the runs follow ``copy_loops``.

Backends ("auto"): Triton on CUDA (source and destination on one device, or peer devices with
peer access whose memory is mapped in the launching GPU's context: not a pool another process
exported and this one opened on the other GPU, which faults; the service copies between two GPUs
with ``across.copy_across``), a compiled CPU loop (``_fused_cpu``: one call for every region, threads over
pages, no temporary buffer) for host memory, and the torch reference (the oracle; also
``backend="torch"``). A bad call raises :class:`~kvservice.errors.InvalidArgument` and writes
nothing; only the named destination pages' heads ``[hd, hd+h)`` change.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch

from ..errors import InvalidArgument
from ._checks import PageIndices, host_pages
from ._regions import KVRegions, Loops, check_unit, copy_loops, fused_order
from .reference import unit_view

__all__ = ["FusedArgs", "check_fused", "copy_pages", "fused_nbytes"]

FusedBackend = Literal["auto", "torch", "cpu", "triton"]


@dataclasses.dataclass(frozen=True)
class FusedArgs:
    """A checked call: host int64 page arrays and the head geometry in heads."""

    src_pages: np.ndarray  # units of ``unit`` tokens
    dst_pages: np.ndarray
    src_head_start: int
    dst_head_start: int
    num_heads: int
    unit: int

    def kind_geometry(self, src: KVRegions, dst: KVRegions, head_bytes: int) -> tuple[list[int], Loops]:
        """For regions of ``head_bytes`` rows: [page, unit, outer, inner, head offset] bytes of the
        source then the destination side, and the runs of one unit."""
        g = self.unit
        sp, st, sh = src.strides(head_bytes)
        dp, dt, dh = dst.strides(head_bytes)
        order = fused_order((st, sh), (dt, dh), head_bytes)
        loops = copy_loops(g, self.num_heads, head_bytes, (st, sh), (dt, dh), order)
        row = [
            sp,
            g * st,
            *loops.src,
            self.src_head_start * sh,
            dp,
            g * dt,
            *loops.dst,
            self.dst_head_start * dh,
        ]
        return row, loops

    def geometry(self, src: KVRegions, dst: KVRegions) -> tuple[np.ndarray, np.ndarray]:
        """Per region (staging order): ``kind_geometry``'s 10 byte columns and the loop dims
        (outer count, inner count, run bytes)."""
        hbs = [src.head_bytes_k, src.head_bytes_v] if src.v else [src.head_bytes_k]
        kinds = [self.kind_geometry(src, dst, hb) for hb in hbs]
        geom = np.array([row for row, _ in kinds], dtype=np.int64)
        dims = np.array([[lp.outer_count, lp.inner_count, lp.row] for _, lp in kinds], dtype=np.int64)
        return np.tile(geom, (src.num_layers, 1)), np.tile(dims, (src.num_layers, 1))


def fused_nbytes(src: KVRegions, num_pages: int, num_heads: int, unit: int | None = None) -> int:
    """Bytes one call with ``num_pages`` pages (units) of ``num_heads`` heads moves."""
    g = src.page_size if unit is None else unit
    return src.num_layers * num_pages * g * num_heads * (src.head_bytes_k + src.head_bytes_v)


def check_fused(
    src: KVRegions,
    dst: KVRegions,
    src_pages: PageIndices,
    dst_pages: PageIndices,
    src_head_start: int = 0,
    dst_head_start: int = 0,
    num_heads: int | None = None,
    unit: int | None = None,
) -> FusedArgs:
    """Raise InvalidArgument (naming the field) unless the copy is well-formed."""
    if unit is None and src.page_size != dst.page_size:
        raise InvalidArgument("dst.page_size", f"{dst.page_size} differs from the source's {src.page_size}")
    g = check_unit(unit, src.page_size, dst.page_size)
    for field in ("num_layers", "head_bytes_k", "head_bytes_v"):
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            raise InvalidArgument(f"dst.{field}", f"{b} differs from the source's {a}")
    nh = src.num_heads - src_head_start if num_heads is None else num_heads
    for side, start, regions in (("src", src_head_start, src), ("dst", dst_head_start, dst)):
        if start < 0 or nh < 1 or start + nh > regions.num_heads:
            raise InvalidArgument(
                f"{side}_head_start",
                f"heads [{start}, {start + nh}) not within the {regions.num_heads} local heads",
            )
    sp = host_pages(src_pages, src, False, "src_pages", src.page_size // g)
    dp = host_pages(dst_pages, dst, True, "dst_pages", dst.page_size // g)
    if sp.size != dp.size:
        raise InvalidArgument("dst_pages", f"{dp.size} pages for {sp.size} source pages")
    return FusedArgs(sp, dp, src_head_start, dst_head_start, nh, g)


def _torch_copy(src: KVRegions, dst: KVRegions, a: FusedArgs) -> None:
    hbs = (src.head_bytes_k, src.head_bytes_v) if src.v else (src.head_bytes_k,)
    hs, hd, h, g = a.src_head_start, a.dst_head_start, a.num_heads, a.unit
    sp = torch.from_numpy(a.src_pages).to(src.device)
    dp = torch.from_numpy(a.dst_pages).to(dst.device)
    ms, md = src.page_size // g, dst.page_size // g
    for i, (s, d) in enumerate(zip(src.regions, dst.regions, strict=True)):
        hb = hbs[i % len(hbs)]
        sv = unit_view(src, s, hb, g, 1)
        dv = unit_view(dst, d, hb, g, 1)
        rows = sv[sp // ms, sp % ms][:, :, hs : hs + h].to(dv.device)
        dv[dp // md, dp % md, :, hd : hd + h] = rows


def _backend(src: KVRegions, dst: KVRegions, backend: FusedBackend) -> str:
    if backend != "auto":
        return backend
    if src.device.type == "cuda" and dst.device.type == "cuda":
        return "triton"
    if src.device.type == "cpu" and dst.device.type == "cpu":
        return "cpu"
    return "torch"  # host <-> device: the reference copies through the device


def copy_pages(
    src: KVRegions,
    dst: KVRegions,
    src_pages: PageIndices,
    dst_pages: PageIndices,
    *,
    src_head_start: int = 0,
    dst_head_start: int = 0,
    num_heads: int | None = None,
    backend: FusedBackend = "auto",
    unit: int | None = None,
) -> int:
    """Copy the pages (see the module doc); returns the bytes moved. Asynchronous on CUDA
    (the current stream of the source device)."""
    a = check_fused(src, dst, src_pages, dst_pages, src_head_start, dst_head_start, num_heads, unit)
    n = int(a.src_pages.size)
    if n:
        kind = _backend(src, dst, backend)
        if kind == "cpu":
            from . import _fused_cpu

            geom, dims = a.geometry(src, dst)
            _fused_cpu.copy_regions(
                src.base_addresses,
                dst.base_addresses,
                a.src_pages,
                a.dst_pages,
                geom,
                dims,
                src.page_size // a.unit,
                dst.page_size // a.unit,
            )
        elif kind == "triton":
            from . import _fused_triton

            _fused_triton.copy(src, dst, a)
        else:
            _torch_copy(src, dst, a)
    return fused_nbytes(src, n, a.num_heads, a.unit)
