"""Kernel tests run the Triton kernels under TRITON_INTERPRET=1 when no GPU is present."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: must be set before triton.jit decorates the kernels (first import of kvservice.kernels).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvservice.kernels import KVRegions  # noqa: E402

PoolFactory = Callable[..., KVRegions]


def random_bytes(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str
) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bytes (NaN patterns included; compare bytes)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = itemsize
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(device)


@pytest.fixture
def make_regions() -> PoolFactory:
    """Factory: a KV pool of random bytes (MHA: K and V per layer; MLA: ``head_dim_v=0``)."""
    gen = torch.Generator().manual_seed(1234)

    def make(
        *,
        layers: int = 2,
        num_pages: int = 9,
        page_size: int = 4,
        heads: int = 2,
        head_dim: int = 8,
        head_dim_v: int | None = None,
        dtype: torch.dtype = torch.float16,
        device: str = "cpu",
    ) -> KVRegions:
        hd_v = head_dim if head_dim_v is None else head_dim_v
        k = [
            random_bytes((num_pages * page_size, heads, head_dim), dtype, gen, device) for _ in range(layers)
        ]
        v = (
            [random_bytes((num_pages * page_size, heads, hd_v), dtype, gen, device) for _ in range(layers)]
            if hd_v
            else []
        )
        return KVRegions.create(
            k, v, page_size=page_size, num_heads=heads, head_dim_k=head_dim, head_dim_v=hd_v or None
        )

    return make


def _snapshot(regions: KVRegions) -> list[torch.Tensor]:
    out = []
    for i, t in enumerate(regions.regions):
        hb = regions.head_bytes_v if regions.v and i % 2 else regions.head_bytes_k
        shape = (regions.num_pages, regions.page_size, regions.num_heads, hb)
        out.append(t.reshape(-1).view(torch.uint8).view(shape).cpu().clone())
    return out


@pytest.fixture
def snapshot() -> Callable[[KVRegions], list[torch.Tensor]]:
    """Copies of every region (staging order) as uint8 [pages, page_size, heads, head_bytes]."""
    return _snapshot
