"""GPU: the host tier's memory is pinned, and its copies move whole pages of a VRAM pool to the
tier and back byte-exact (the same functions the shm tests run on host pools).

    python -m pytest tests/gpu/test_gpu_tier.py -v -p no:cacheprovider -o addopts=""
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvservice_client import Layout

from kvservice.buffers import BufferSet
from kvservice.buffers.memory import MappedRegion
from kvservice.tier._copy import from_tier, to_tier
from kvservice.tier._memory import host_pages

pytestmark = pytest.mark.gpu

LAYOUT = Layout.mha(num_layers=3, page_size=16, num_pages=64, total_kv_heads=4, head_dim=64, dtype="bfloat16")


def _vram_set() -> BufferSet:
    rb = LAYOUT.region_bytes_k
    regions = []
    for _ in range(2 * LAYOUT.num_layers):
        t = torch.randint(0, 256, (rb,), dtype=torch.uint8, device="cuda")
        regions.append(MappedRegion(t.data_ptr(), rb, "VRAM", 0, t, "test"))
    n = LAYOUT.num_layers
    return BufferSet("bs", "s", "e", LAYOUT, tuple(regions[:n]), tuple(regions[n:]), ())


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_tier_memory_is_pinned_with_cuda() -> None:
    """With CUDA present the arena is page-locked host memory."""
    assert host_pages(8, 4096).is_pinned()


def test_vram_pages_round_trip_through_the_tier() -> None:
    """Scattered VRAM pages copied to tier slots and back into other pages are byte-exact."""
    bs = _vram_set()
    arena = host_pages(32, bs.page_bytes).numpy()
    src = np.array([5, 63, 0, 17, 18, 40], dtype=np.int64)
    slots = np.array([31, 2, 7, 8, 0, 15], dtype=np.int64)
    to_tier(bs, src, arena, slots)
    want = [torch.cat([r.pages(r.size // 64)[p].cpu() for r in bs.regions]).numpy() for p in src]
    assert all((arena[s] == w).all() for s, w in zip(slots, want, strict=True))
    dst = np.array([1, 2, 3, 60, 61, 62], dtype=np.int64)
    from_tier(bs, dst, arena, slots)
    got = [torch.cat([r.pages(r.size // 64)[p].cpu() for r in bs.regions]).numpy() for p in dst]
    assert all((g == w).all() for g, w in zip(got, want, strict=True))
