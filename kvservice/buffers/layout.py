"""Validation of a registered layout and its regions against each other.

Every check raises :class:`InvalidArgument` naming the offending field; nothing is imported or
changed before validation passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

from kvservice_client import Layout
from kvservice_client.contract import DTYPE_ITEMSIZE, PageLayout

from ..errors import InvalidArgument

__all__ = ["MAX_LAYERS", "MAX_PAGES", "validate_layout", "validate_region_sizes"]

MAX_LAYERS = 4096
MAX_PAGES = 1 << 26
MAX_HEAD_DIM = 8192
PAGE_LAYOUTS = get_args(PageLayout)


def validate_layout(layout: Layout) -> None:
    """Check the layout on its own (kinds, ranges, TP consistency, head counts)."""
    if layout.kind not in ("mha", "mla"):
        raise InvalidArgument("layout.kind", "must be BUFFER_KIND_MHA or BUFFER_KIND_MLA")
    if layout.page_layout not in PAGE_LAYOUTS:
        raise InvalidArgument(
            "layout.page_layout", "must be PAGE_LAYOUT_NHD, _HND, _HND_KV, _KV_NHD, _KV_HND, _NHC or _HNC"
        )
    if layout.kind == "mla" and layout.page_layout != "nhd":
        raise InvalidArgument("layout.page_layout", "MLA pools are NHD (one latent head)")
    if layout.dtype not in DTYPE_ITEMSIZE:
        raise InvalidArgument("layout.dtype", "must be set (DTYPE_UNSPECIFIED is not a dtype)")
    if not 1 <= layout.num_layers <= MAX_LAYERS:
        raise InvalidArgument("layout.num_layers", f"must be in 1..{MAX_LAYERS}, got {layout.num_layers}")
    if not 1 <= layout.page_size <= 1 << 16:
        raise InvalidArgument("layout.page_size", f"must be in 1..65536, got {layout.page_size}")
    if not 1 <= layout.num_pages <= MAX_PAGES:
        raise InvalidArgument("layout.num_pages", f"must be in 1..{MAX_PAGES}, got {layout.num_pages}")
    if not 1 <= layout.tp_size <= 1024:
        raise InvalidArgument("layout.tp_size", f"must be in 1..1024, got {layout.tp_size}")
    if layout.tp_rank >= layout.tp_size:
        raise InvalidArgument("layout.tp_rank", f"must be < tp_size ({layout.tp_size}), got {layout.tp_rank}")
    if not 1 <= layout.head_dim_k <= MAX_HEAD_DIM:
        raise InvalidArgument("layout.head_dim_k", f"must be in 1..{MAX_HEAD_DIM}, got {layout.head_dim_k}")
    if layout.kind == "mla":
        if layout.head_dim_v != 0:
            raise InvalidArgument("layout.head_dim_v", "must be 0 for MLA (one latent region per layer)")
        if layout.total_kv_heads != 1 or layout.local_kv_heads != 1:
            raise InvalidArgument("layout.local_kv_heads", "MLA has exactly one (latent) head")
        return
    if not 1 <= layout.head_dim_v <= MAX_HEAD_DIM:
        raise InvalidArgument("layout.head_dim_v", f"must be in 1..{MAX_HEAD_DIM}, got {layout.head_dim_v}")
    if layout.total_kv_heads < 1:
        raise InvalidArgument("layout.total_kv_heads", "must be >= 1")
    if layout.tp_size <= layout.total_kv_heads:
        if layout.total_kv_heads % layout.tp_size:
            raise InvalidArgument(
                "layout.total_kv_heads",
                f"{layout.total_kv_heads} heads do not split evenly over tp_size {layout.tp_size}",
            )
        want = layout.total_kv_heads // layout.tp_size
    else:
        if layout.tp_size % layout.total_kv_heads:
            raise InvalidArgument(
                "layout.tp_size",
                f"tp_size {layout.tp_size} > {layout.total_kv_heads} heads must be a multiple of them",
            )
        want = 1  # replicated heads: every rank holds one head
    if layout.local_kv_heads != want:
        raise InvalidArgument(
            "layout.local_kv_heads",
            f"must be {want} for {layout.total_kv_heads} heads at tp_size {layout.tp_size}, "
            f"got {layout.local_kv_heads}",
        )


def validate_region_sizes(layout: Layout, k_sizes: Sequence[int], v_sizes: Sequence[int]) -> None:
    """Region counts per kind and sizes = pages x page bytes."""
    if len(k_sizes) != layout.num_layers:
        raise InvalidArgument(
            "k_regions", f"expected {layout.num_layers} (one per layer), got {len(k_sizes)}"
        )
    if len(v_sizes) != layout.num_v_regions:
        want = (
            f"{layout.num_layers} (one per layer)"
            if layout.num_v_regions
            else "none for MLA"
            if layout.kind == "mla"
            else f"none for page layout {layout.page_layout} (V is in the K region)"
        )
        raise InvalidArgument("v_regions", f"expected {want}, got {len(v_sizes)}")
    for name, sizes, want_size in (
        ("k_regions", k_sizes, layout.region_bytes_k),
        ("v_regions", v_sizes, layout.region_bytes_v),
    ):
        for i, size in enumerate(sizes):
            if size != want_size:
                raise InvalidArgument(
                    f"{name}[{i}].size_bytes",
                    f"must be num_pages x page bytes = {layout.num_pages} x "
                    f"{want_size // layout.num_pages} = {want_size}, got {size}",
                )
