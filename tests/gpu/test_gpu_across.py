"""GPU: the two-GPU copy (kernels/across.py) against the torch reference, in chunks, with head
slices (mixed TP) and page-size conversion; pages not named stay as they were (needs 2 GPUs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvservice.kernels import KVRegions
from kvservice.kernels.across import copy_across
from kvservice.kernels.fused import copy_pages

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

LAYERS, DIM = 3, 64


def pool(device: str, pages: int, page_size: int, heads: int, seed: int) -> KVRegions:
    g = torch.Generator(device=device).manual_seed(seed)
    n = pages * page_size * heads * DIM * 2  # bf16 bytes per region
    ts = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g) for _ in range(2 * LAYERS)
    ]
    return KVRegions.create(
        ts[:LAYERS], ts[LAYERS:], page_size=page_size, num_heads=heads, head_dim_k=DIM, itemsize=2
    )


@pytest.mark.parametrize(
    ("src_geom", "dst_geom", "heads", "unit", "chunk"),
    [
        ((16, 8), (16, 8), (0, 0, 8), None, 1 << 20),  # same shape, many chunks
        ((16, 8), (16, 4), (4, 0, 4), None, 256 << 20),  # TP 1 -> 2: the upper half of the heads
        ((16, 4), (32, 8), (0, 4, 4), 16, 64 << 10),  # TP 2 -> 1 into block 32, one page a chunk
    ],
)
def test_copy_across_matches_reference(src_geom, dst_geom, heads, unit, chunk) -> None:
    (sps, sh), (dps, dh) = src_geom, dst_geom
    src = pool("cuda:0", 64, sps, sh, 1)
    dst = pool("cuda:1", 64, dps, dh, 2)
    want = pool("cuda:1", 64, dps, dh, 2)  # same seed: the same starting bytes
    per = (dps // (unit or dps)) * 64
    rng = np.random.default_rng(0)
    n = 40
    sp = rng.permutation((sps // (unit or sps)) * 64)[:n].astype(np.int64)
    dp = rng.permutation(per)[:n].astype(np.int64)
    hs, hd, h = heads
    kw = {"src_head_start": hs, "dst_head_start": hd, "num_heads": h, "unit": unit}
    copy_pages(src, want, sp, dp, backend="torch", **kw)
    pack_s, link_s = torch.cuda.Stream(device=0), torch.cuda.Stream(device=0)
    out = torch.cuda.Stream(device=1)
    with torch.cuda.device(1), torch.cuda.stream(out):
        for _ in range(2):  # twice: the second call reuses the landing blocks of the first
            nbytes = copy_across(
                src, dst, sp, dp, pack_stream=pack_s, link_stream=link_s, chunk_bytes=chunk, **kw
            )
    out.synchronize()
    assert nbytes > 0
    for a, b in zip(dst.regions, want.regions, strict=True):
        assert torch.equal(a, b)
