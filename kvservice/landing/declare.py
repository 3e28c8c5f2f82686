"""Validating a landing declaration and building the landing view it lands in.

A landing transfer is an ordinary receiver declaration whose destination is a *landing view*:
a :class:`~kvservice.buffers.BufferSet` under the engine's buffer set id, with the engine's layout
but ``num_pages = n`` and regions cut from the landing pool. Senders write its pages ``0..n-1``
through the usual receive path (same-node fused, packed), never knowing the difference::

    sequence positions  [0 ........ prefix_pages) [prefix_pages ........ prefix_pages + n)
    engine pool         prefix_page_indices        (not allocated yet)
    landing view                                   pages 0 .. n-1         ──Claim──▶ dst pages
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..buffers import BufferSet, MappedRegion
from ..errors import InvalidArgument

__all__ = ["landing_dst", "landing_view"]


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
        raise InvalidArgument("aux", "a landing transfer carries no aux rows; declare them without landing")
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


def landing_view(
    bs: BufferSet, pages: int, views: list[torch.Tensor], mem_kind: str, device: int
) -> BufferSet:
    """``bs`` with ``pages`` pages whose regions are ``views`` (uint8 tensors, K then V)."""
    regions = tuple(
        MappedRegion(int(t.data_ptr()), int(t.numel()), mem_kind, device, t, "landing") for t in views
    )
    n = bs.layout.num_layers
    return dataclasses.replace(
        bs, layout=dataclasses.replace(bs.layout, num_pages=pages), k=regions[:n], v=regions[n:], aux=()
    )


def region_sizes(bs: BufferSet, pages: int) -> list[int]:
    """Bytes of each KV region of a landing of ``pages`` pages (K then V, like ``bs.regions``)."""
    return [r.size // bs.layout.num_pages * pages for r in bs.regions]
