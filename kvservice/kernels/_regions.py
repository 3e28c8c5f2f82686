"""The KV regions of one buffer set as the pack/unpack kernels see them, and the staging layout.

A region is one layer's K or V (MHA) or latent (MLA) memory, any dtype, viewed as bytes::

    region:  [num_pages][page_size][num_heads][head_bytes]      head_bytes = head_dim * itemsize
    page p:  bytes [p * page_bytes, (p + 1) * page_bytes)

Staging layout of one pack/unpack (destination-major; ``S`` head slices of ``h`` heads each)::

    [slice s < S]                        one contiguous range per destination rank (one WRITE)
      [layer l < L]
        [K | V]                          MLA: the latent (K) only
          [page i < n, selection order]  i-th page of the call's page list
            [token t < page_size]
              [head j < h]               source head head_start + s*h + j of the local heads
                [head_bytes]

    slice_bytes  = L * n * page_size * h * (head_bytes_k + head_bytes_v)
    segment(s, l, K) = s * slice_bytes + l * n * page_size * h * (head_bytes_k + head_bytes_v)
    segment(s, l, V) = segment(s, l, K) + n * page_size * h * head_bytes_k

Why: each destination's bytes are one range; within a (slice, layer, K/V) segment a page is
``page_size`` rows of ``h * head_bytes`` (one run when ``h`` is every local head), so both
kernels read and write long contiguous runs, and the receiver of a mixed-TP split scatters
each sender's buffer at its own head offset without reshuffling.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import InvalidArgument

__all__ = ["KVRegions", "packed_nbytes"]


@dataclasses.dataclass(frozen=True)
class KVRegions:
    """All layers' regions of one engine rank's KV pool, validated once at registration.

    ``k[l]``/``v[l]`` are contiguous tensors (any dtype, any shape) of exactly
    ``num_pages * page_bytes`` bytes; ``v`` is empty for MLA. Build with :meth:`create`.
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    page_size: int
    num_heads: int
    head_bytes_k: int
    head_bytes_v: int
    num_pages: int

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
    ) -> KVRegions:
        """Validate and wrap; ``itemsize`` defaults to ``k[0].element_size()``.

        Raises InvalidArgument (field ``regions``) on empty/mismatched/non-contiguous regions.
        """
        k, v = tuple(k), tuple(v or ())
        if not k:
            raise InvalidArgument("regions.k", "need at least one layer")
        if v and len(v) != len(k):
            raise InvalidArgument("regions.v", f"{len(v)} V regions for {len(k)} K regions")
        if page_size < 1 or num_heads < 1 or head_dim_k < 1:
            raise InvalidArgument("regions", "page_size, num_heads and head_dim_k must be >= 1")
        isz = k[0].element_size() if itemsize is None else itemsize
        hd_v = (head_dim_k if head_dim_v is None else head_dim_v) if v else 0
        token_k, token_v = num_heads * head_dim_k * isz, num_heads * hd_v * isz
        num_pages = k[0].numel() * k[0].element_size() // (page_size * token_k)
        dev = k[0].device
        for name, regs, token in (("k", k, token_k), ("v", v, token_v)):
            for i, t in enumerate(regs):
                if t.device != dev:
                    raise InvalidArgument(f"regions.{name}[{i}]", f"on {t.device}, expected {dev}")
                if not t.is_contiguous():
                    raise InvalidArgument(f"regions.{name}[{i}]", "must be contiguous")
                if t.numel() * t.element_size() != num_pages * page_size * token or num_pages < 1:
                    raise InvalidArgument(
                        f"regions.{name}[{i}]",
                        f"{t.numel() * t.element_size()} bytes, expected {num_pages} pages of "
                        f"{page_size * token}",
                    )
        return cls(k, v, page_size, num_heads, head_dim_k * isz, hd_v * isz, num_pages)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

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
            return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=self.device)

        return {"all": table(self.regions), "k": table(self.k), "v": table(self.v)}

    @functools.cached_property
    def base_addresses(self) -> np.ndarray:
        """int64 base address of every region (staging order), on the host."""
        return np.array([t.data_ptr() for t in self.regions], dtype=np.int64)

    @functools.cached_property
    def region_head_bytes(self) -> np.ndarray:
        """int64 bytes of one head's row in every region (staging order)."""
        hbs = [self.head_bytes_k, self.head_bytes_v] if self.v else [self.head_bytes_k]
        return np.array(hbs * self.num_layers, dtype=np.int64)

    @functools.cached_property
    def min_alignment(self) -> int:
        """Largest power of two (<= 16) dividing every region's base address."""
        gcd = 16
        for t in self.regions:
            gcd = _pow2_gcd(gcd, t.data_ptr())
        return gcd


def _pow2_gcd(a: int, b: int) -> int:
    while a > 1 and b % a:
        a //= 2
    return a


def packed_nbytes(regions: KVRegions, num_pages: int, num_heads: int, num_slices: int = 1) -> int:
    """Bytes a pack of ``num_pages`` pages and ``num_slices`` slices of ``num_heads`` heads fills."""
    head_bytes = regions.head_bytes_k + regions.head_bytes_v
    return num_slices * regions.num_layers * num_pages * regions.page_size * num_heads * head_bytes
