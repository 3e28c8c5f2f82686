"""KV regions as torch tensors, for tests of the routes and the inbound side without a service."""

from __future__ import annotations

import numpy as np
import torch
from kvservice_client import Layout

from kvservice.kernels import KVRegions

__all__ = ["LAYOUT", "pages_of", "random_regions", "small_layout"]


def small_layout(page_size: int = 4) -> Layout:
    """Two layers, 32 pages of ``page_size`` tokens, two heads of 8 (float16, TP 1)."""
    return Layout.mha(
        num_layers=2,
        page_size=page_size,
        num_pages=32,
        total_kv_heads=2,
        head_dim=8,
        dtype="float16",
        tp_size=1,
        tp_rank=0,
    )


LAYOUT = small_layout()


def random_regions(lay: Layout, seed: int) -> KVRegions:
    """CPU KV regions of ``lay`` filled with random bytes (seeded)."""
    g = torch.Generator().manual_seed(seed)

    def region(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    k = [region(lay.region_bytes_k) for _ in range(lay.num_layers)]
    v = [region(lay.region_bytes_v) for _ in range(lay.num_v_regions)]
    return KVRegions.of_layout(lay, k, v)


def pages_of(r: KVRegions, lay: Layout, pages: np.ndarray) -> list[torch.Tensor]:
    """Every region's bytes of ``pages`` (in order), for comparisons."""
    out = []
    for t, pb in [(t, lay.page_bytes_k) for t in r.k] + [(t, lay.page_bytes_v) for t in (r.v or [])]:
        out.append(t.view(-1, pb)[torch.as_tensor(pages)])
    return out
