"""Fused page-to-page copy: every backend against the torch oracle and against pack -> unpack.

Byte-exact per region; pages and heads the call did not name stay as they were.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvservice import kernels
from kvservice.errors import InvalidArgument
from kvservice.kernels import KVRegions, plan_heads
from kvservice.kernels.fused import copy_pages, fused_nbytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["auto", "torch", "triton"] + (["cpu"] if DEVICE == "cpu" else [])
LAYOUTS = {
    "mha-fp16": {"heads": 2, "head_dim": 8},
    "mha-kv-differ": {"heads": 2, "head_dim": 8, "head_dim_v": 4},
    "mla": {"heads": 1, "head_dim": 12, "head_dim_v": 0},
    "mha-odd-bytes": {"heads": 3, "head_dim": 3, "dtype": torch.uint8},
}


def _expected(
    src: KVRegions,
    dst: KVRegions,
    snap: Callable[[KVRegions], list[torch.Tensor]],
    sp: np.ndarray,
    dp: np.ndarray,
    hs: int,
    hd: int,
    h: int,
) -> list[torch.Tensor]:
    want = snap(dst)
    for s, d in zip(snap(src), want, strict=True):
        d[torch.from_numpy(dp), :, hd : hd + h] = s[torch.from_numpy(sp), :, hs : hs + h]
    return want


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_matches_reference_and_leaves_neighbours(
    make_regions: Callable[..., KVRegions],
    snapshot: Callable[..., list[torch.Tensor]],
    layout: str,
    backend: str,
) -> None:
    kw = LAYOUTS[layout]
    src = make_regions(num_pages=11, device=DEVICE, **kw)
    dst = make_regions(num_pages=13, device=DEVICE, **kw)
    sp = np.array([7, 0, 3, 10, 5], dtype=np.int64)
    dp = np.array([12, 1, 2, 6, 9], dtype=np.int64)
    want = _expected(src, dst, snapshot, sp, dp, 0, 0, src.num_heads)
    moved = copy_pages(src, dst, sp, dp, backend=backend)  # type: ignore[arg-type]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert moved == fused_nbytes(src, 5, src.num_heads)
    for got, exp in zip(snapshot(dst), want, strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("h,p,d", [(8, 2, 4), (8, 4, 2), (4, 1, 4), (2, 4, 2), (8, 8, 2)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_tp_routes_equal_pack_unpack(
    make_regions: Callable[..., KVRegions],
    snapshot: Callable[..., list[torch.Tensor]],
    h: int,
    p: int,
    d: int,
    backend: str,
) -> None:
    """Every sender rank's route, fused, gives the receiver ranks what pack -> unpack gives."""
    lh_s, lh_d = max(1, h // p), max(1, h // d)
    senders = [make_regions(num_pages=6, heads=lh_s, device=DEVICE) for _ in range(p)]
    fused = [make_regions(num_pages=8, heads=lh_d, device=DEVICE) for _ in range(d)]
    packed = [
        KVRegions.create(
            [t.clone() for t in r.k],
            [t.clone() for t in r.v],
            page_size=r.page_size,
            num_heads=lh_d,
            head_dim_k=8,
        )
        for r in fused
    ]
    sp = np.array([4, 1, 5], dtype=np.int64)
    dp = np.array([0, 7, 3], dtype=np.int64)
    for r in plan_heads(h, p, d):
        copy_pages(
            senders[r.src_rank],
            fused[r.dst_rank],
            sp,
            dp,
            src_head_start=r.src_head_start,
            dst_head_start=r.dst_head_start,
            num_heads=r.num_heads,
            backend=backend,  # type: ignore[arg-type]
        )
        staged = kernels.pack(senders[r.src_rank], sp, head_start=r.src_head_start, num_heads=r.num_heads)
        kernels.unpack(packed[r.dst_rank], staged, dp, head_start=r.dst_head_start, num_heads=r.num_heads)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for a, b in zip(fused, packed, strict=True):
        for x, y in zip(snapshot(a), snapshot(b), strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("parallel", [False, True])
def test_many_pages_threads_and_head_slice(
    make_regions: Callable[..., KVRegions],
    snapshot: Callable[..., list[torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
    parallel: bool,
) -> None:
    """Many pages, a middle head slice; the CPU loop's serial and threaded builds."""
    from kvservice.kernels import _fused_cpu

    monkeypatch.setattr(_fused_cpu, "PARALLEL_BYTES", 0 if parallel else 1 << 40)
    src = make_regions(num_pages=600, heads=4, head_dim=16, layers=3, device=DEVICE)
    dst = make_regions(num_pages=700, heads=4, head_dim=16, layers=3, device=DEVICE)
    rng = np.random.default_rng(5)
    sp = rng.permutation(600)[:500]
    dp = rng.permutation(700)[:500]
    want = _expected(src, dst, snapshot, sp, dp, 1, 2, 2)
    copy_pages(src, dst, sp, dp, src_head_start=1, dst_head_start=2, num_heads=2)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for got, exp in zip(snapshot(dst), want, strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"dst_pages": [0, 0]}, "dst_pages"),
        ({"dst_pages": [0]}, "dst_pages"),
        ({"src_pages": [0, 11]}, "src_pages"),
        ({"dst_head_start": 2}, "dst_head_start"),
        ({"src_head_start": 1, "num_heads": 2}, "src_head_start"),
    ],
)
def test_bad_calls_raise_and_write_nothing(
    make_regions: Callable[..., KVRegions],
    snapshot: Callable[..., list[torch.Tensor]],
    kwargs: dict,
    field: str,
) -> None:
    src = make_regions(num_pages=11, device=DEVICE)
    dst = make_regions(num_pages=11, device=DEVICE)
    before = snapshot(dst)
    args = {"src_pages": [1, 2], "dst_pages": [3, 4], **kwargs}
    with pytest.raises(InvalidArgument) as err:
        copy_pages(src, dst, **args)
    assert err.value.field == field
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(dst), strict=True))


def test_layout_mismatch_is_refused(make_regions: Callable[..., KVRegions]) -> None:
    src = make_regions(page_size=4, device=DEVICE)
    with pytest.raises(InvalidArgument, match="page_size"):
        copy_pages(src, make_regions(page_size=8, device=DEVICE), [0], [0])
    with pytest.raises(InvalidArgument, match="num_layers"):
        copy_pages(src, make_regions(layers=3, device=DEVICE), [0], [0])
