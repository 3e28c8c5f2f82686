"""Validating a landing declaration and building the landing view it lands in.

A landing transfer is an ordinary receiver declaration whose destination is a *landing view*:
a :class:`~kvservice.buffers.BufferSet` under the engine's buffer set id, with the engine's layout
but ``num_pages = n`` and regions cut from the landing pool. Senders write its pages ``0..n-1``
through the usual receive path (same-node fused, packed), never knowing the difference::

    sequence positions  [0 ........ prefix_pages) [prefix_pages ........ prefix_pages + n)
    engine pool         prefix_page_indices        (not allocated yet)
    landing view                                   pages 0 .. n-1         ──Claim──▶ dst pages

Aux rows (``Landing.aux``: a row count per aux region name) land beside the pages: the view has one
aux region per declared name, of exactly that many rows, in host memory of the landing pool. The
declaration's rows are the view's rows ``0..count-1``; the senders name as many of theirs, and the
Claim names the engine's destination rows::

    aux "meta"   sender rows [9]  ──▶  landing view rows [0]  ──Claim──▶  engine rows [aux_index]
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ...buffers import AuxBuffer, BufferSet, MappedRegion
from ...errors import InvalidArgument

__all__ = ["aux_sizes", "landing_aux_rows", "landing_dst", "landing_view", "region_sizes"]


def landing_dst(
    bs: BufferSet,
    pages: int,
    dst_page_indices: object,
    aux: dict[str, np.ndarray],
    publish_tokens: np.ndarray | None,
    prefix_pages: int,
) -> np.ndarray:
    """The landing view's delta pages ``0..n-1``; ``pages`` 0 derives ``n`` from the tokens."""
    if len(dst_page_indices):  # type: ignore[arg-type]
        raise InvalidArgument(
            "dst_page_indices", "must be empty for a landing transfer (the Claim names the pages)"
        )
    if aux:
        raise InvalidArgument(
            "aux",
            "must be empty for a landing transfer (count its aux rows in landing.aux; "
            "the Claim names the rows)",
        )
    if not pages:
        if publish_tokens is None:
            raise InvalidArgument(
                "landing.pages", "is required (> 0) unless publish_tokens gives the sequence"
            )
        pages = -(-int(publish_tokens.size) // bs.layout.page_size) - prefix_pages
        if pages < 1:
            raise InvalidArgument(
                "landing.pages",
                f"publish_tokens cover {publish_tokens.size} tokens, nothing past the "
                f"{prefix_pages} prefix pages",
            )
    if pages > bs.layout.num_pages:
        raise InvalidArgument(
            "landing.pages",
            f"{pages} pages exceed the buffer set's {bs.layout.num_pages} (it could never claim them)",
        )
    return np.arange(pages, dtype=np.int64)


def landing_aux_rows(bs: BufferSet, counts: dict[str, int]) -> dict[str, np.ndarray]:
    """``Landing.aux`` as the declaration's aux rows: rows ``0..count-1`` of each landing aux region."""
    rows: dict[str, np.ndarray] = {}
    for name, n in counts.items():
        mine = bs.aux_by_name(name)
        if mine is None:
            raise InvalidArgument("landing.aux", f"buffer set has no aux region named {name!r}")
        if not 0 < n <= mine.num_rows:
            raise InvalidArgument(
                f"landing.aux[{name}].num_rows",
                f"must be 1..{mine.num_rows} (the region's rows; the claim copies them into as many)",
            )
        rows[name] = np.arange(n, dtype=np.int64)
    return rows


def landing_view(
    bs: BufferSet,
    pages: int,
    views: list[torch.Tensor],
    mem_kind: str,
    device: int,
    aux: dict[str, torch.Tensor] | None = None,
) -> BufferSet:
    """``bs`` with ``pages`` pages whose regions are ``views`` (uint8 tensors, K then V), and one aux
    region per entry of ``aux`` (name -> uint8 host tensor of whole rows)."""
    regions = tuple(
        MappedRegion(int(t.data_ptr()), int(t.numel()), mem_kind, device, t, "landing") for t in views
    )
    aux_regions = []
    for name, t in (aux or {}).items():
        mine = bs.aux_by_name(name)
        assert mine is not None  # NOTE: landing_aux_rows checked the names
        region = MappedRegion(int(t.data_ptr()), int(t.numel()), "DRAM", 0, t, "landing")
        aux_regions.append(AuxBuffer(name, region, mine.row_bytes, int(t.numel()) // mine.row_bytes))
    n = bs.layout.num_layers
    return dataclasses.replace(
        bs,
        layout=dataclasses.replace(bs.layout, num_pages=pages),
        k=regions[:n],
        v=regions[n:],
        aux=tuple(aux_regions),
    )


def region_sizes(bs: BufferSet, pages: int) -> list[int]:
    """Bytes of each KV region of a landing of ``pages`` pages (K then V, like ``bs.regions``)."""
    return [r.size // bs.layout.num_pages * pages for r in bs.regions]


def aux_sizes(bs: BufferSet, rows: dict[str, np.ndarray]) -> list[int]:
    """Bytes of each landing aux region for the declaration's ``rows`` (in their order)."""
    return [bs.aux_by_name(name).row_bytes * int(r.size) for name, r in rows.items()]  # type: ignore[union-attr]
