"""Fused page-to-page copy between two KV pools of one node: no staging, one pass over the bytes.

``copy_pages(src, dst, src_pages, dst_pages, ...)`` writes, for every layer's K and V (MHA) or
latent (MLA), the heads ``[src_head_start, +num_heads)`` of source page ``src_pages[i]`` into
heads ``[dst_head_start, +num_heads)`` of destination page ``dst_pages[i]``::

    src region  [num_pages][page_size][src heads][head_bytes]     (src.num_heads = H / sender TP)
    dst region  [num_pages][page_size][dst heads][head_bytes]     (dst.num_heads = H / receiver TP)
    token row:  src[sp, t, hs:hs+h]  ──▶  dst[dp, t, hd:hd+h]      for every region, page, token

Backends ("auto"): Triton on CUDA (source and destination on one device, or peer devices with
peer access), a compiled CPU loop (``_fused_cpu``: one call for every region, threads over
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
from ._checks import PageIndices, pages_tensor
from ._regions import KVRegions

__all__ = ["FusedArgs", "check_fused", "copy_pages", "fused_nbytes"]

FusedBackend = Literal["auto", "torch", "cpu", "triton"]


@dataclasses.dataclass(frozen=True)
class FusedArgs:
    """A checked call: pages as int64 tensors on each side's device, head geometry in heads."""

    src_pages: torch.Tensor
    dst_pages: torch.Tensor
    src_head_start: int
    dst_head_start: int
    num_heads: int

    def geometry(self, src: KVRegions, dst: KVRegions) -> tuple[np.ndarray, np.ndarray]:
        """Per region (staging order): [src_page, src_token, src_off, dst_page, dst_token, dst_off]
        bytes, and the bytes of a token row copied."""
        hbs = np.array(
            [src.head_bytes_k, src.head_bytes_v] * src.num_layers
            if src.v
            else [src.head_bytes_k] * src.num_layers,
            dtype=np.int64,
        )
        ps = src.page_size
        geom = np.stack(
            [
                ps * src.num_heads * hbs,
                src.num_heads * hbs,
                self.src_head_start * hbs,
                ps * dst.num_heads * hbs,
                dst.num_heads * hbs,
                self.dst_head_start * hbs,
            ],
            axis=1,
        )
        return geom, self.num_heads * hbs


def fused_nbytes(src: KVRegions, num_pages: int, num_heads: int) -> int:
    """Bytes one call with ``num_pages`` pages of ``num_heads`` heads moves."""
    return src.num_layers * num_pages * src.page_size * num_heads * (src.head_bytes_k + src.head_bytes_v)


def check_fused(
    src: KVRegions,
    dst: KVRegions,
    src_pages: PageIndices,
    dst_pages: PageIndices,
    src_head_start: int = 0,
    dst_head_start: int = 0,
    num_heads: int | None = None,
) -> FusedArgs:
    """Raise InvalidArgument (naming the field) unless the copy is well-formed."""
    for field in ("num_layers", "page_size", "head_bytes_k", "head_bytes_v"):
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
    sp = pages_tensor(src_pages, src, unique=False, field="src_pages")
    dp = pages_tensor(dst_pages, dst, unique=True, field="dst_pages")
    if sp.numel() != dp.numel():
        raise InvalidArgument("dst_pages", f"{dp.numel()} pages for {sp.numel()} source pages")
    return FusedArgs(sp, dp, src_head_start, dst_head_start, nh)


def _torch_copy(src: KVRegions, dst: KVRegions, a: FusedArgs) -> None:
    hbs = (src.head_bytes_k, src.head_bytes_v) if src.v else (src.head_bytes_k,)
    hs, hd, h = a.src_head_start, a.dst_head_start, a.num_heads
    dp = a.dst_pages
    for i, (s, d) in enumerate(zip(src.regions, dst.regions, strict=True)):
        hb = hbs[i % len(hbs)]
        sv = s.reshape(-1).view(torch.uint8).view(src.num_pages, src.page_size, src.num_heads, hb)
        dv = d.reshape(-1).view(torch.uint8).view(dst.num_pages, dst.page_size, dst.num_heads, hb)
        rows = sv.index_select(0, a.src_pages)[:, :, hs : hs + h].to(dv.device)
        target = dv if h == dst.num_heads else dv[:, :, hd : hd + h]
        target.index_copy_(0, dp if dp.device == dv.device else dp.to(dv.device), rows)


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
) -> int:
    """Copy the pages (see the module doc); returns the bytes moved. Asynchronous on CUDA
    (the current stream of the source device)."""
    a = check_fused(src, dst, src_pages, dst_pages, src_head_start, dst_head_start, num_heads)
    n = a.src_pages.numel()
    if n:
        kind = _backend(src, dst, backend)
        if kind == "cpu":
            from . import _fused_cpu

            geom, rows = a.geometry(src, dst)
            _fused_cpu.copy_regions(
                np.array([t.data_ptr() for t in src.regions], dtype=np.int64),
                np.array([t.data_ptr() for t in dst.regions], dtype=np.int64),
                a.src_pages.numpy(),
                a.dst_pages.numpy(),
                geom,
                rows,
                src.page_size,
            )
        elif kind == "triton":
            from . import _fused_triton

            _fused_triton.copy(src, dst, a)
        else:
            _torch_copy(src, dst, a)
    return fused_nbytes(src, n, a.num_heads)
