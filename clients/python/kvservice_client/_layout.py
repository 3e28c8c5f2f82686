"""The layout of a KV pool (a buffer set), shared by clients and the service.

MHA (one K and one V region per layer, NHD)::

    region k[l] / v[l]:  [num_pages * page_size, local_kv_heads, head_dim]
    page p of a region:  bytes [p * page_bytes, (p + 1) * page_bytes)
    page_bytes         = page_size * local_kv_heads * head_dim * itemsize

MLA (one latent region per layer, replicated across TP ranks)::

    region k[l]:         [num_pages * page_size, 1, head_dim_k]   (head_dim_k = latent dim)

``page_layout`` orders the bytes inside a page (MHA): "nhd" as above (token-major), "hnd"
(``[local_kv_heads][page_size][head_dim]`` per page, separate K and V regions), or one region per
layer holding K and V:

    layout   a page of the layer's region                       engine cache (per layer)
    hnd_kv   [heads][K: page_size x dk | V: page_size x dv]     vLLM CPU [blocks, heads, bs, 2*d]
    kv_nhd   [K: page_size x heads x dk][V: page_size x heads x dv]
                                                                FlashInfer [blocks, 2, bs, heads, d]
    kv_hnd   [K: heads x page_size x dk][V: heads x page_size x dv]
                                                                the same, HND stride order
    nhc      [page_size][heads][K dk | V dv]                    vLLM >= 0.32 GPU [blocks, heads,
                                                                bs, 2*d] in LBNHC order (default)
    hnc      [heads][page_size][K dk | V dv]                    the same in LBHNC order

Pools whose per-token rows agree exchange KV across page layouts and page sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ._proto import common_pb2

__all__ = ["DTYPE_ITEMSIZE", "KV_IN_ONE_REGION", "Layout"]

Kind = Literal["mha", "mla"]
PageLayout = Literal["nhd", "hnd", "hnd_kv", "kv_nhd", "kv_hnd", "nhc", "hnc"]
# page layouts whose one region per layer holds the layer's K and V (no V regions)
KV_IN_ONE_REGION = frozenset({"hnd_kv", "kv_nhd", "kv_hnd", "nhc", "hnc"})

DTYPE_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}
_DTYPE_PB = {
    "float16": common_pb2.DTYPE_FLOAT16,
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float32": common_pb2.DTYPE_FLOAT32,
    "float8_e4m3": common_pb2.DTYPE_FLOAT8_E4M3,
    "float8_e5m2": common_pb2.DTYPE_FLOAT8_E5M2,
    "uint8": common_pb2.DTYPE_UINT8,
}
_PB_DTYPE = {v: k for k, v in _DTYPE_PB.items()}
_KIND_PB = {"mha": common_pb2.BUFFER_KIND_MHA, "mla": common_pb2.BUFFER_KIND_MLA}
_PB_KIND = {v: k for k, v in _KIND_PB.items()}
_PAGE_LAYOUT_PB = {
    "nhd": common_pb2.PAGE_LAYOUT_NHD,
    "hnd": common_pb2.PAGE_LAYOUT_HND,
    "hnd_kv": common_pb2.PAGE_LAYOUT_HND_KV,
    "kv_nhd": common_pb2.PAGE_LAYOUT_KV_NHD,
    "kv_hnd": common_pb2.PAGE_LAYOUT_KV_HND,
    "nhc": common_pb2.PAGE_LAYOUT_NHC,
    "hnc": common_pb2.PAGE_LAYOUT_HNC,
}
_PB_PAGE_LAYOUT = {v: k for k, v in _PAGE_LAYOUT_PB.items()}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Layout of one engine rank's KV pool; see the module docstring for the byte layout."""

    kind: Kind
    num_layers: int
    page_size: int
    num_pages: int
    total_kv_heads: int
    local_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    dtype: str
    tp_size: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    page_layout: PageLayout = "nhd"

    @classmethod
    def mha(
        cls,
        *,
        num_layers: int,
        page_size: int,
        num_pages: int,
        total_kv_heads: int,
        head_dim: int,
        dtype: str,
        tp_size: int = 1,
        tp_rank: int = 0,
        dp_rank: int = 0,
        head_dim_v: int | None = None,
        page_layout: PageLayout = "nhd",
    ) -> Layout:
        """MHA layout; local heads follow from TP (replicated when tp_size > total_kv_heads)."""
        return cls(
            kind="mha",
            num_layers=num_layers,
            page_size=page_size,
            num_pages=num_pages,
            total_kv_heads=total_kv_heads,
            local_kv_heads=max(1, total_kv_heads // max(tp_size, 1)),
            head_dim_k=head_dim,
            head_dim_v=head_dim if head_dim_v is None else head_dim_v,
            dtype=dtype,
            tp_size=tp_size,
            tp_rank=tp_rank,
            dp_rank=dp_rank,
            page_layout=page_layout,
        )

    @classmethod
    def mla(
        cls,
        *,
        num_layers: int,
        page_size: int,
        num_pages: int,
        latent_dim: int,
        dtype: str,
        tp_size: int = 1,
        tp_rank: int = 0,
        dp_rank: int = 0,
    ) -> Layout:
        return cls(
            kind="mla",
            num_layers=num_layers,
            page_size=page_size,
            num_pages=num_pages,
            total_kv_heads=1,
            local_kv_heads=1,
            head_dim_k=latent_dim,
            head_dim_v=0,
            dtype=dtype,
            tp_size=tp_size,
            tp_rank=tp_rank,
            dp_rank=dp_rank,
        )

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def page_bytes_k(self) -> int:
        return self.page_size * self.local_kv_heads * self.head_dim_k * self.itemsize

    @property
    def page_bytes_v(self) -> int:
        return self.page_size * self.local_kv_heads * self.head_dim_v * self.itemsize

    @property
    def region_bytes_k(self) -> int:
        """Bytes of a K (or latent) region; with K and V in one region (``KV_IN_ONE_REGION``) the
        layer's K and V together."""
        if self.page_layout in KV_IN_ONE_REGION:
            return self.num_pages * (self.page_bytes_k + self.page_bytes_v)
        return self.num_pages * self.page_bytes_k

    @property
    def region_bytes_v(self) -> int:
        return self.num_pages * self.page_bytes_v

    @property
    def num_v_regions(self) -> int:
        return self.num_layers if self.kind == "mha" and self.page_layout not in KV_IN_ONE_REGION else 0

    @property
    def page_bytes_all_layers(self) -> int:
        """Bytes one page occupies across every layer and K/V."""
        return self.num_layers * (self.page_bytes_k + (self.page_bytes_v if self.kind == "mha" else 0))

    def to_proto(self) -> common_pb2.Layout:
        return common_pb2.Layout(
            kind=_KIND_PB.get(self.kind, common_pb2.BUFFER_KIND_UNSPECIFIED),
            num_layers=self.num_layers,
            page_size=self.page_size,
            num_pages=self.num_pages,
            total_kv_heads=self.total_kv_heads,
            local_kv_heads=self.local_kv_heads,
            head_dim_k=self.head_dim_k,
            head_dim_v=self.head_dim_v,
            dtype=_DTYPE_PB.get(self.dtype, common_pb2.DTYPE_UNSPECIFIED),
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            dp_rank=self.dp_rank,
            page_layout=_PAGE_LAYOUT_PB.get(self.page_layout, -1),  # type: ignore[arg-type]
        )

    @classmethod
    def from_proto(cls, pb: common_pb2.Layout) -> Layout:
        """Convert without validating; unknown enums become '' (the service rejects them)."""
        return cls(
            kind=_PB_KIND.get(pb.kind, ""),  # type: ignore[arg-type]
            num_layers=pb.num_layers,
            page_size=pb.page_size,
            num_pages=pb.num_pages,
            total_kv_heads=pb.total_kv_heads,
            local_kv_heads=pb.local_kv_heads,
            head_dim_k=pb.head_dim_k,
            head_dim_v=pb.head_dim_v,
            dtype=_PB_DTYPE.get(pb.dtype, ""),
            tp_size=pb.tp_size,
            tp_rank=pb.tp_rank,
            dp_rank=pb.dp_rank,
            page_layout=_PB_PAGE_LAYOUT.get(pb.page_layout, ""),  # type: ignore[arg-type]
        )
