"""Cross-layout, cross-page-size copies: every backend moves token t of the source to token t of
the destination, per head, byte-exact, whatever either side's page layout (nhd / hnd / hnd_kv /
FlashInfer's kv_nhd and kv_hnd / vLLM 0.32's nhc and hnc)
and page size (through units of their gcd), with mixed-TP head slices; nothing else changes.

The oracle is independent of the kernels: each pool is read back as canonical per-token rows
``[tokens, heads, head_dim]`` through its own tensor shape (a permute of the engine's view).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from kvservice import kernels
from kvservice.errors import InvalidArgument
from kvservice.kernels import KVRegions
from kvservice.kernels.fused import copy_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PACK_BACKENDS = ["torch", "triton"] + (["cpu"] if DEVICE == "cpu" else [])
FUSED_BACKENDS = ["torch", "triton"] + (["cpu"] if DEVICE == "cpu" else [])
PAGE_LAYOUTS = ["nhd", "hnd", "hnd_kv", "kv_nhd", "kv_hnd", "nhc", "hnc"]
# (sender page, receiver page): SGLang 1/64, vLLM 16/32; the receiver's page equal, larger and
# smaller (each direction, page 1 on either side)
PAIRS = [(16, 16), (1, 16), (16, 1), (64, 16), (16, 64), (16, 32), (32, 16)]
L, D = 2, 8


class Pool:
    """An engine-shaped KV pool: ``raw`` as the engine allocates it, ``regions`` for the kernels."""

    def __init__(
        self, layout: str, pages: int, page: int, heads: int, seed: int, dv: int = D, dk: int = D
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.layout, self.page, self.heads, self.dk, self.dv = layout, page, heads, dk, dv

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randint(-30000, 30000, shape, generator=gen, dtype=torch.int16).to(DEVICE)

        geometry: dict[str, Any] = dict(
            page_size=page, num_heads=heads, head_dim_k=dk, head_dim_v=dv, page_layout=layout
        )
        if layout == "hnd_kv":  # vLLM CPU: [blocks, heads, block_size, K | V] (here dv == dk)
            self.k = [rnd(pages, heads, 2 * page, dk) for _ in range(L)]
            self.v: list[torch.Tensor] = []
            self.regions = KVRegions.create(self.k, None, **geometry)
            return
        if layout.startswith("kv_") or layout in ("nhc", "hnc"):
            # FlashInfer [blocks, 2, block_size, heads, dim]; vLLM 0.32 [blocks, (block, heads), K|V]
            inner = {
                "kv_nhd": (2, page, heads, dk),
                "kv_hnd": (2, heads, page, dk),
                "nhc": (page, heads, dk + dv),
                "hnc": (heads, page, dk + dv),
            }[layout]
            self.k = [rnd(pages, *inner) for _ in range(L)]
            self.v = []
            self.regions = KVRegions.create(self.k, None, **geometry)
            return
        kshape = (pages, page, heads, dk) if layout == "nhd" else (pages, heads, page, dk)
        vshape = (pages, page, heads, dv) if layout == "nhd" else (pages, heads, page, dv)
        self.k = [rnd(*kshape) for _ in range(L)]
        self.v = [rnd(*vshape) for _ in range(L)]
        self.regions = KVRegions.create(self.k, self.v, **geometry)

    def tokens(self) -> list[torch.Tensor]:
        """Per layer, K then V: ``[pages * page, heads, dim]`` copies in token order."""
        out = []
        for layer in range(L):
            if self.layout == "hnd_kv":
                t = self.k[layer]
                parts = [t[:, :, : self.page], t[:, :, self.page :]]
            elif self.layout.startswith("kv_"):
                parts = [self.k[layer][:, 0], self.k[layer][:, 1]]
            elif self.layout in ("nhc", "hnc"):
                parts = [self.k[layer][..., : self.dk], self.k[layer][..., self.dk :]]
            else:
                parts = [self.k[layer], self.v[layer]]
            for x in parts:
                if self.layout not in ("nhd", "kv_nhd", "nhc"):
                    x = x.permute(0, 2, 1, 3)
                out.append(x.reshape(-1, self.heads, x.shape[-1]).cpu().clone())
        return out


def _token_index(units: np.ndarray, page: int, g: int) -> torch.Tensor:
    m = page // g
    first = (units // m) * page + (units % m) * g
    return torch.from_numpy((first[:, None] + np.arange(g)[None, :]).reshape(-1))


def _want(src: Pool, dst: Pool, su: np.ndarray, du: np.ndarray, g: int, hs: int, hd: int, h: int) -> list:
    want = dst.tokens()
    si, di = _token_index(su, src.page, g), _token_index(du, dst.page, g)
    for s, d in zip(src.tokens(), want, strict=True):
        d[di, hd : hd + h] = s[si, hs : hs + h]
    return want


def _units(pool: Pool, g: int, n: int, seed: int) -> np.ndarray:
    total = pool.regions.num_pages * pool.page // g
    return np.random.default_rng(seed).permutation(total)[:n].astype(np.int64)


def _check(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"region {i} differs"


@pytest.mark.parametrize("pages", PAIRS, ids=lambda p: f"{p[0]}to{p[1]}")
@pytest.mark.parametrize("dst_layout", PAGE_LAYOUTS)
@pytest.mark.parametrize("src_layout", PAGE_LAYOUTS)
@pytest.mark.parametrize("backend", PACK_BACKENDS)
def test_pack_unpack_converts(backend: str, src_layout: str, dst_layout: str, pages: tuple[int, int]) -> None:
    ps, pr = pages
    g = math.gcd(ps, pr)
    src = Pool(src_layout, 6, ps, 2, seed=1)
    dst = Pool(dst_layout, 9, pr, 2, seed=2)
    n = min(6 * ps, 9 * pr) // g // 2
    su, du = _units(src, g, n, 3), _units(dst, g, n, 4)
    want = _want(src, dst, su, du, g, 0, 0, 2)
    staged = kernels.pack(src.regions, su, unit=g, head_major=dst.regions.head_major, backend=backend)  # type: ignore[arg-type]
    kernels.unpack(dst.regions, staged, du, unit=g, backend=backend)  # type: ignore[arg-type]
    _check(dst.tokens(), want)


@pytest.mark.parametrize("src_layout", ["hnd_kv", "kv_nhd", "kv_hnd", "nhc", "hnc"])
@pytest.mark.parametrize("backend", PACK_BACKENDS)
@pytest.mark.parametrize("staging_head_major", [False, True])
def test_mixed_tp_slices_convert(backend: str, staging_head_major: bool, src_layout: str) -> None:
    """TP1 vLLM (CPU or FlashInfer) with 4 heads -> TP2 nhd page-1 receivers (SGLang): one pack,
    two slices."""
    src = Pool(src_layout, 5, 16, 4, seed=5)
    dsts = [Pool("nhd", 80, 1, 2, seed=6 + r) for r in range(2)]
    # Three 16-token pages as 1-token units (head-major staging orders heads within a unit, so
    # both sides name the same unit; token-major staging would not care).
    su = np.repeat(np.array([3, 0, 4]) * 16, 16) + np.tile(np.arange(16), 3)
    staged = kernels.pack(
        src.regions,
        su,
        num_heads=2,
        num_slices=2,
        unit=1,
        head_major=staging_head_major,
        backend=backend,  # type: ignore[arg-type]
    )
    per_slice = staged.numel() // 2
    rng = np.random.default_rng(7)
    for r, dst in enumerate(dsts):
        du = rng.permutation(80)[:48].astype(np.int64)  # 48 single-token pages
        want = _want(src, dst, su, du, 1, 2 * r, 0, 2)
        kernels.unpack(
            dst.regions,
            staged[r * per_slice : (r + 1) * per_slice],
            du,
            unit=1,
            head_major=staging_head_major,
            backend=backend,  # type: ignore[arg-type]
        )
        _check(dst.tokens(), want)


@pytest.mark.parametrize("pages", PAIRS, ids=lambda p: f"{p[0]}to{p[1]}")
@pytest.mark.parametrize("dst_layout", PAGE_LAYOUTS)
@pytest.mark.parametrize("src_layout", PAGE_LAYOUTS)
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_fused_converts(backend: str, src_layout: str, dst_layout: str, pages: tuple[int, int]) -> None:
    ps, pr = pages
    g = math.gcd(ps, pr)
    src = Pool(src_layout, 6, ps, 4, seed=11)
    dst = Pool(dst_layout, 9, pr, 2, seed=12)
    n = min(6 * ps, 9 * pr) // g // 2
    su, du = _units(src, g, n, 13), _units(dst, g, n, 14)
    want = _want(src, dst, su, du, g, 2, 0, 2)  # heads 2..3 of a TP1 sender into a TP2 rank
    moved = copy_pages(
        src.regions,
        dst.regions,
        su,
        du,
        src_head_start=2,
        num_heads=2,
        unit=g,
        backend=backend,  # type: ignore[arg-type]
    )
    assert moved == L * n * g * 2 * 2 * D * 2
    _check(dst.tokens(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pages", PAIRS, ids=lambda p: f"{p[0]}to{p[1]}")
@pytest.mark.parametrize("dst_layout", PAGE_LAYOUTS)
@pytest.mark.parametrize("src_layout", PAGE_LAYOUTS)
def test_cuda_kernels_convert_engine_sized_rows(
    src_layout: str, dst_layout: str, pages: tuple[int, int]
) -> None:
    """On CUDA ("auto": the compiled Triton kernels), 256-byte head rows and enough units to fill
    every program: heads 2..3 of a TP1 sender land in a TP2 rank byte-exact, fused and packed."""
    ps, pr = pages
    g, tokens = math.gcd(ps, pr), 512
    src = Pool(src_layout, 2 * tokens // ps + 3, ps, 4, seed=41, dk=128, dv=128)
    dsts = [Pool(dst_layout, 2 * tokens // pr + 3, pr, 2, seed=42, dk=128, dv=128) for _ in range(2)]
    su, du = _units(src, g, tokens // g, 43), _units(dsts[0], g, tokens // g, 44)
    want = _want(src, dsts[0], su, du, g, 2, 0, 2)
    copy_pages(src.regions, dsts[0].regions, su, du, src_head_start=2, num_heads=2, unit=g)
    head_major = dsts[1].regions.head_major
    staged = kernels.pack(src.regions, su, head_start=2, num_heads=2, unit=g, head_major=head_major)
    kernels.unpack(dsts[1].regions, staged, du, unit=g)
    torch.cuda.synchronize()
    for dst in dsts:
        _check(dst.tokens(), want)


@pytest.mark.parametrize("src_layout,dst_layout", [("nhd", "hnd"), ("nhc", "hnd"), ("nhd", "hnc")])
def test_k_and_v_dims_differ_across_layouts(src_layout: str, dst_layout: str) -> None:
    src = Pool(src_layout, 4, 1, 2, seed=21, dv=4)
    dst = Pool(dst_layout, 3, 16, 2, seed=22, dv=4)
    su, du = np.arange(4, dtype=np.int64), np.array([5, 17, 18, 40], dtype=np.int64)
    want = _want(src, dst, su, du, 1, 0, 0, 2)
    for backend in PACK_BACKENDS:
        staged = kernels.pack(src.regions, su, unit=1, head_major=True, backend=backend)  # type: ignore[arg-type]
        kernels.unpack(dst.regions, staged, du, unit=1, backend=backend)  # type: ignore[arg-type]
        _check(dst.tokens(), want)


def test_bad_units_are_refused_and_change_nothing() -> None:
    src, dst = Pool("nhd", 4, 64, 2, seed=31), Pool("hnd_kv", 4, 16, 2, seed=32)
    before = dst.tokens()
    with pytest.raises(InvalidArgument, match="unit"):
        kernels.pack(src.regions, [0], unit=24)
    with pytest.raises(InvalidArgument, match="page_size"):
        copy_pages(src.regions, dst.regions, [0], [0])  # different page sizes need a unit
    with pytest.raises(InvalidArgument, match=r"dst_pages.*\[0, 64\)"):
        copy_pages(src.regions, dst.regions, [0], [64], unit=1)
    with pytest.raises(InvalidArgument, match="distinct"):
        staged = kernels.pack(src.regions, [0, 1], unit=16)
        kernels.unpack(dst.regions, staged, [3, 3], unit=16)
    with pytest.raises(InvalidArgument, match="regions.v"):
        KVRegions.create(dst.k, dst.k, page_size=16, num_heads=2, head_dim_k=D, page_layout="hnd_kv")
    _check(dst.tokens(), before)
