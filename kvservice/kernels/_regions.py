"""The KV regions of one buffer set as the pack/unpack kernels see them, and the staging layout.

A region is one layer's K or V (MHA) or latent (MLA) memory, any dtype, viewed as bytes. The
token ``t``, head ``j`` row of page ``p`` (``head_bytes`` long) sits at::

    p * page_stride + t * token_stride + j * head_stride

    page layout   page_stride           token_stride   head_stride        (per region, bytes)
    nhd           P * H * hb            H * hb         hb                 [page][token][head]
    hnd           P * H * hb            hb             P * hb             [page][head][token]
    hnd_kv        P * H * (hbk + hbv)   hb             P * (hbk + hbv)    one region a layer:
                                                                          [page][head][K rows|V rows]
    kv_nhd        P * H * (hbk + hbv)   H * hb         hb                 one region a layer:
                                                                          [page][K|V][token][head]
    kv_hnd        P * H * (hbk + hbv)   hb             P * hb             one region a layer:
                                                                          [page][K|V][head][token]
    nhc           P * H * (hbk + hbv)   H * (hbk+hbv)  hbk + hbv          one region a layer:
                                                                          [page][token][head][K|V]
    hnc           P * H * (hbk + hbv)   hbk + hbv      P * (hbk + hbv)    one region a layer:
                                                                          [page][head][token][K|V]

(The V region of a one-region layout is a view of the layer's region, ``P * hbk`` bytes in for
``hnd_kv``, ``P * H * hbk`` for ``kv_nhd``/``kv_hnd``, ``hbk`` for ``nhc``/``hnc``: FlashInfer's
``[blocks, 2, ...]`` cache, K and V side by side in each block, and vLLM 0.32's ``[blocks, heads,
block_size, K|V]`` caches are each two strided regions of one allocation.) A call moves
*units* of ``g`` tokens (``g`` divides the page size; default a whole page): unit ``u`` is tokens
``(u % m) * g + [0, g)`` of page ``u // m`` (``m = P / g``), so pools of different page sizes
exchange tokens through the units of ``gcd`` of both sizes.

Staging layout of one pack/unpack (destination-major; ``S`` head slices of ``h`` heads each)::

    [slice s < S]                        one contiguous range per destination rank (one WRITE)
      [layer l < L]
        [K | V]                          MLA: the latent (K) only
          [unit i < n, selection order]  i-th unit of the call's unit list
            [token t < g] [head j < h]   token-major staging (default for nhd / kv_nhd pools), or
            [head j < h] [token t < g]   head-major staging (default for the head-major pools)
              [head_bytes]               source head head_start + s*h + j of the local heads

    slice_bytes  = L * n * g * h * (head_bytes_k + head_bytes_v)
    segment(s, l, K) = s * slice_bytes + l * n * g * h * (head_bytes_k + head_bytes_v)
    segment(s, l, V) = segment(s, l, K) + n * g * h * head_bytes_k

Why: each destination's bytes are one range; within a segment a unit is ``g`` rows of
``h * head_bytes`` (token-major) or ``h`` rows of ``g * head_bytes`` (head-major), one run when
the pool's page is ordered the same way, so both kernels read and write long runs; the
receiver of a mixed-TP split scatters each sender's buffer at its own head offset, and a
sender packs in the receiver's order so that the receiver's unpack is the straight copy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgument

__all__ = [
    "HEAD_MAJOR",
    "KV_IN_ONE_REGION",
    "PAGE_LAYOUTS",
    "KVRegions",
    "Loops",
    "copy_loops",
    "packed_nbytes",
    "pow2_divisor",
]

PAGE_LAYOUTS = ("nhd", "hnd", "hnd_kv", "kv_nhd", "kv_hnd", "nhc", "hnc")
KV_IN_ONE_REGION = ("hnd_kv", "kv_nhd", "kv_hnd", "nhc", "hnc")  # no V regions: V is a view of K's
HEAD_MAJOR = ("hnd", "hnd_kv", "kv_hnd", "hnc")  # a page's rows ordered by head first
# bytes from a layer's region to its V (one-region layouts): K rows of a head, of a page, or of a token
_V_SKIP = {"hnd_kv": "head", "kv_nhd": "page", "kv_hnd": "page", "nhc": "row", "hnc": "row"}


@dataclasses.dataclass(frozen=True)
class KVRegions:
    """All layers' regions of one engine rank's KV pool, validated once at registration.

    ``k[l]``/``v[l]`` are contiguous tensors (any dtype, any shape) of exactly
    ``num_pages * page_bytes`` bytes (``KV_IN_ONE_REGION``: ``k[l]`` holds the layer's K and V,
    ``v[l]`` is a byte view of it, ``page_size * head_bytes_k`` in for ``hnd_kv``, ``page_size *
    num_heads * head_bytes_k`` for ``kv_nhd``/``kv_hnd``); ``v`` is empty for MLA. Build with
    :meth:`create`.
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    page_size: int
    num_heads: int
    head_bytes_k: int
    head_bytes_v: int
    num_pages: int
    page_layout: str = "nhd"
    # (device, base address of every region in staging order) when a kernel on another GPU than
    # the tensors' reaches them through other pointers (``aliased``); the tensors stay as they are
    alias: tuple[torch.device, tuple[int, ...]] | None = None

    @classmethod
    def of_layout(cls, layout: Any, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None) -> KVRegions:
        """:meth:`create` with the geometry of a ``kvservice_client.Layout`` (page size, local
        heads, head dims, itemsize, page layout)."""
        return cls.create(
            k,
            v or None,
            page_size=layout.page_size,
            num_heads=layout.local_kv_heads,
            head_dim_k=layout.head_dim_k,
            head_dim_v=layout.head_dim_v or None,
            itemsize=layout.itemsize,
            page_layout=layout.page_layout,
        )

    @classmethod
    def create(
        cls,
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor] | None = None,
        *,
        page_size: int,
        num_heads: int,
        head_dim_k: int,
        head_dim_v: int | None = None,
        itemsize: int | None = None,
        page_layout: str = "nhd",
    ) -> KVRegions:
        """Validate and wrap; ``itemsize`` defaults to ``k[0].element_size()``.

        Raises InvalidArgument (field ``regions``) on empty/mismatched/non-contiguous regions.
        """
        k, v = tuple(k), tuple(v or ())
        if not k:
            raise InvalidArgument("regions.k", "need at least one layer")
        if page_layout not in PAGE_LAYOUTS:
            raise InvalidArgument(
                "regions.page_layout", f"must be one of {PAGE_LAYOUTS}, got {page_layout!r}"
            )
        if page_size < 1 or num_heads < 1 or head_dim_k < 1:
            raise InvalidArgument("regions", "page_size, num_heads and head_dim_k must be >= 1")
        isz = k[0].element_size() if itemsize is None else itemsize
        fused_kv = page_layout in KV_IN_ONE_REGION
        if fused_kv and v:
            raise InvalidArgument("regions.v", f"{page_layout} keeps V inside the K regions")
        if v and len(v) != len(k):
            raise InvalidArgument("regions.v", f"{len(v)} V regions for {len(k)} K regions")
        hd_v = (head_dim_k if head_dim_v is None else head_dim_v) if v or fused_kv else 0
        # NOTE: with K and V in one region the K "page" checked here is the layer's whole page.
        page_k = page_size * num_heads * (head_dim_k + (hd_v if fused_kv else 0)) * isz
        num_pages = k[0].numel() * k[0].element_size() // page_k
        dev = k[0].device
        for name, regs, page in (("k", k, page_k), ("v", v, page_size * num_heads * hd_v * isz)):
            for i, t in enumerate(regs):
                if t.device != dev:
                    raise InvalidArgument(f"regions.{name}[{i}]", f"on {t.device}, expected {dev}")
                if not t.is_contiguous():
                    raise InvalidArgument(f"regions.{name}[{i}]", "must be contiguous")
                if t.numel() * t.element_size() != num_pages * page or num_pages < 1:
                    raise InvalidArgument(
                        f"regions.{name}[{i}]",
                        f"{t.numel() * t.element_size()} bytes, expected {num_pages} pages of {page}",
                    )
        if fused_kv:  # V starts after a head's K rows, the page's K half or a row's K: a byte view
            skip = (
                head_dim_k
                * isz
                * {"head": page_size, "page": page_size * num_heads, "row": 1}[_V_SKIP[page_layout]]
            )
            v = tuple(t.reshape(-1).view(torch.uint8)[skip:] for t in k)
        return cls(k, v, page_size, num_heads, head_dim_k * isz, hd_v * isz, num_pages, page_layout)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def device(self) -> torch.device:
        """Where kernels over these regions launch: the tensors' GPU, or the alias's."""
        return self.k[0].device if self.alias is None else self.alias[0]

    def aliased(self, device: torch.device, addresses: Sequence[int]) -> KVRegions:
        """These regions as a kernel on ``device`` reaches them: ``addresses`` (staging order,
        e.g. ``buffers.memory.alias_addresses``) instead of the tensors' pointers. Only the
        Triton kernels use an alias (they take base addresses); views and the torch reference
        keep the tensors."""
        if len(addresses) != len(self.regions):
            raise InvalidArgument("addresses", f"{len(addresses)} for {len(self.regions)} regions")
        return dataclasses.replace(self, alias=(device, tuple(int(a) for a in addresses)))

    def on_device(
        self, device: torch.device, translate: Callable[[list[int], int], list[int] | None]
    ) -> KVRegions | None:
        """:meth:`aliased` on ``device`` with the addresses ``translate`` (base addresses, GPU
        index) gives, made once per device and kept with these regions (their pointer tables
        too); None, and asked again next time, when ``translate`` finds no mapping."""
        cache: dict[torch.device, KVRegions] = self.__dict__.setdefault("_on_device", {})
        hit = cache.get(device)
        if hit is None:
            addresses = translate(self.base_addresses.tolist(), device.index or 0)
            if addresses is None:
                return None
            hit = cache[device] = self.aliased(device, addresses)
        return hit

    def _pointers(self, ts: Sequence[torch.Tensor]) -> list[int]:
        if self.alias is None:
            return [t.data_ptr() for t in ts]
        at = {id(t): a for t, a in zip(self.regions, self.alias[1], strict=True)}
        return [at[id(t)] for t in ts]

    @property
    def regions(self) -> tuple[torch.Tensor, ...]:
        """Regions in staging order: K0, V0, K1, V1, ... (MHA) or K0, K1, ... (MLA)."""
        if not self.v:
            return self.k
        return tuple(t for pair in zip(self.k, self.v, strict=True) for t in pair)

    @functools.cached_property
    def pointer_tables(self) -> dict[str, torch.Tensor]:
        """int64 base addresses on the regions' device: 'all' (staging order), 'k', 'v'."""

        def table(ts: Sequence[torch.Tensor]) -> torch.Tensor:
            return torch.tensor(self._pointers(ts), dtype=torch.int64, device=self.device)

        return {"all": table(self.regions), "k": table(self.k), "v": table(self.v)}

    @property
    def head_major(self) -> bool:
        """Whether a page is ordered by head first (``HEAD_MAJOR``): the default staging order."""
        return self.page_layout in HEAD_MAJOR

    def strides(self, head_bytes: int) -> tuple[int, int, int]:
        """(page, token, head) byte strides of a region whose head rows are ``head_bytes`` long."""
        p, h = self.page_size, self.num_heads
        if self.page_layout == "nhd":
            return p * h * head_bytes, h * head_bytes, head_bytes
        if self.page_layout == "hnd":
            return p * h * head_bytes, head_bytes, p * head_bytes
        both = self.head_bytes_k + self.head_bytes_v
        if self.page_layout == "kv_nhd":
            return p * h * both, h * head_bytes, head_bytes
        if self.page_layout == "kv_hnd":
            return p * h * both, head_bytes, p * head_bytes
        if self.page_layout == "nhc":
            return p * h * both, h * both, both
        if self.page_layout == "hnc":
            return p * h * both, both, p * both
        return p * h * both, head_bytes, p * both

    @functools.cached_property
    def base_addresses(self) -> np.ndarray:
        """int64 base address of every region (staging order), on the host."""
        return np.array(self._pointers(self.regions), dtype=np.int64)

    @functools.cached_property
    def min_alignment(self) -> int:
        """Largest power of two (<= 16) dividing every region's base address."""
        return pow2_divisor(*self._pointers(self.regions), cap=16)


def pow2_divisor(*values: int, cap: int) -> int:
    """The largest power of two, at most ``cap`` (a power of two), dividing every value: the
    widest word a copy of rows at these addresses and strides can move."""
    a = cap
    for b in values:
        while a > 1 and b % a:
            a //= 2
    return a


def packed_nbytes(
    regions: KVRegions, num_units: int, num_heads: int, num_slices: int = 1, unit: int | None = None
) -> int:
    """Bytes a pack of ``num_units`` units (of ``unit`` tokens, default a page) and ``num_slices``
    slices of ``num_heads`` heads fills."""
    g = regions.page_size if unit is None else unit
    head_bytes = regions.head_bytes_k + regions.head_bytes_v
    return num_slices * regions.num_layers * num_units * g * num_heads * head_bytes


def check_unit(unit: int | None, *page_sizes: int) -> int:
    """The unit (tokens) of a call: divides every page size; default the (first) page size."""
    g = page_sizes[0] if unit is None else unit
    if g < 1 or any(p % g for p in page_sizes):
        raise InvalidArgument("unit", f"{g} tokens must be >= 1 and divide the page size(s) {page_sizes}")
    return g


@dataclasses.dataclass(frozen=True)
class Loops:
    """How one unit of one region is copied: ``outer x inner`` runs of ``row`` bytes, the run
    ``(a, b)`` at ``a * outer + b * inner`` bytes from the unit's first byte on either side."""

    outer_count: int
    inner_count: int
    row: int
    src: tuple[int, int]  # (outer, inner) byte strides on the source side
    dst: tuple[int, int]


def copy_loops(
    unit: int,
    heads: int,
    head_bytes: int,
    src: tuple[int, int],
    dst: tuple[int, int],
    head_major: bool,
) -> Loops:
    """Runs that copy ``unit`` tokens x ``heads`` heads between sides of (token, head) byte
    strides ``src`` and ``dst``, visited head-major or token-major; rows that are contiguous on
    both sides merge into one run (a whole unit when both sides hold it in one piece)."""
    counts = (heads, unit) if head_major else (unit, heads)
    so, si = src[::-1] if head_major else src
    do, di = dst[::-1] if head_major else dst
    if si == head_bytes and di == head_bytes:
        row = counts[1] * head_bytes
        if so == row and do == row:
            return Loops(1, 1, counts[0] * row, (0, 0), (0, 0))
        return Loops(counts[0], 1, row, (so, 0), (do, 0))
    return Loops(counts[0], counts[1], head_bytes, (so, si), (do, di))


def staging_strides(unit: int, heads: int, head_bytes: int, head_major: bool) -> tuple[int, int]:
    """(token, head) byte strides of a unit in staging (see the module doc)."""
    return (head_bytes, unit * head_bytes) if head_major else (heads * head_bytes, head_bytes)


def fused_order(a: tuple[int, int], b: tuple[int, int], head_bytes: int) -> bool:
    """Visit order of a pool-to-pool copy: head-major when only that makes runs on both sides."""
    return not (a[1] == head_bytes and b[1] == head_bytes) and a[0] == head_bytes and b[0] == head_bytes
