"""Triton pack/unpack (interpreted on CPU) against the torch reference on awkward shapes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvservice import kernels
from kvservice.errors import InvalidArgument
from kvservice.kernels import _triton, reference
from kvservice.kernels._checks import distinct

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and no TRITON_INTERPRET"
)
FP8 = getattr(torch, "float8_e4m3fn", torch.uint8)

# (layers, num_pages, page_size, heads, head_dim, head_dim_v, dtype, head_start, num_heads, num_slices)
SHAPES = [
    pytest.param(2, 11, 16, 2, 128, None, torch.bfloat16, 0, None, 1, id="mha-ps16-hd128-bf16"),
    pytest.param(1, 7, 1, 2, 64, None, torch.float32, 0, None, 1, id="mha-ps1-hd64-fp32"),
    pytest.param(1, 5, 64, 1, 64, None, FP8, 0, None, 1, id="mha-ps64-hd64-fp8"),
    pytest.param(2, 9, 16, 1, 576, 0, torch.bfloat16, 0, None, 1, id="mla-hd576-bf16"),
    pytest.param(1, 9, 4, 1, 576, 0, FP8, 0, None, 1, id="mla-hd576-fp8"),
    pytest.param(2, 9, 4, 8, 16, None, torch.float16, 2, 2, 1, id="slice-2of8-fp16"),
    pytest.param(1, 9, 4, 8, 16, None, torch.float16, 0, 4, 2, id="slices-8to2x4"),
    pytest.param(1, 9, 4, 8, 16, None, torch.float32, 0, 2, 4, id="slices-8to4x2"),
    pytest.param(1, 9, 4, 2, 8, None, torch.bfloat16, 0, 1, 2, id="slices-2to1x2"),
    pytest.param(2, 7, 3, 3, 3, None, FP8, 1, 2, 1, id="odd-bytes-hd3-fp8"),
    pytest.param(2, 7, 4, 2, 6, 4, torch.float16, 0, None, 1, id="kv-widths-differ"),
]


def _pool_kwargs(layers, num_pages, page_size, heads, head_dim, head_dim_v, dtype):  # type: ignore[no-untyped-def]
    return dict(
        layers=layers,
        num_pages=num_pages,
        page_size=page_size,
        heads=heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        device=DEVICE,
    )


def _pages(num_pages: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(num_pages)[:n]


@needs_triton
@pytest.mark.parametrize("layers,num_pages,page_size,heads,head_dim,head_dim_v,dtype,hs,nh,ns", SHAPES)
def test_pack_matches_reference(
    make_regions, layers, num_pages, page_size, heads, head_dim, head_dim_v, dtype, hs, nh, ns
):  # type: ignore[no-untyped-def]
    """Triton pack writes exactly the bytes the reference writes, for an odd scattered selection."""
    src = make_regions(**_pool_kwargs(layers, num_pages, page_size, heads, head_dim, head_dim_v, dtype))
    pages = _pages(num_pages, num_pages // 2 + 1, 0)
    want = reference.pack(src, pages, head_start=hs, num_heads=nh, num_slices=ns)
    got = _triton.pack(src, pages, head_start=hs, num_heads=nh, num_slices=ns)
    assert got.numel() == kernels.packed_nbytes(src, len(pages), nh or heads - hs, ns)
    assert torch.equal(got.cpu(), want.cpu())


@needs_triton
@pytest.mark.parametrize("layers,num_pages,page_size,heads,head_dim,head_dim_v,dtype,hs,nh,ns", SHAPES)
def test_unpack_matches_reference_and_spares_canaries(
    make_regions, snapshot, layers, num_pages, page_size, heads, head_dim, head_dim_v, dtype, hs, nh, ns
):  # type: ignore[no-untyped-def]
    """Triton unpack equals reference unpack; pages and heads outside the call are untouched."""
    kw = _pool_kwargs(layers, num_pages, page_size, heads, head_dim, head_dim_v, dtype)
    src, dst = make_regions(**kw), make_regions(**kw)
    pages_src, pages_dst = _pages(num_pages, num_pages // 2 + 1, 1), _pages(num_pages, num_pages // 2 + 1, 2)
    staging = reference.pack(src, pages_src, head_start=hs, num_heads=nh, num_slices=ns)
    before = snapshot(dst)
    _triton.unpack(dst, staging, pages_dst, head_start=hs, num_heads=nh, num_slices=ns)
    got = snapshot(dst)
    # Reference on a fresh copy of the original destination.
    ref_dst = make_regions(**kw)
    for t, b in zip(ref_dst.regions, before, strict=True):
        t.reshape(-1).view(torch.uint8).copy_(b.reshape(-1).to(t.device))
    reference.unpack(ref_dst, staging, pages_dst, head_start=hs, num_heads=nh, num_slices=ns)
    he = hs + ns * (nh or heads - hs)
    outside = np.setdiff1d(np.arange(num_pages), pages_dst)
    for g, w, b, s in zip(got, snapshot(ref_dst), before, snapshot(src), strict=True):
        assert torch.equal(g, w)
        assert torch.equal(g[outside], b[outside])  # canary pages
        assert torch.equal(g[pages_dst][:, :, :hs], b[pages_dst][:, :, :hs])  # heads below the slice
        assert torch.equal(g[pages_dst][:, :, he:], b[pages_dst][:, :, he:])  # heads above the slice
        assert torch.equal(g[pages_dst][:, :, hs:he], s[pages_src][:, :, hs:he])  # pack∘unpack = id


GATED = [p for p in SHAPES if p.id in ("mha-ps16-hd128-bf16", "slices-8to2x4", "kv-widths-differ")]


@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("layers,num_pages,page_size,heads,head_dim,head_dim_v,dtype,hs,nh,ns", GATED)
def test_a_gated_unpack_writes_only_through_an_open_gate(
    make_regions,
    snapshot,
    backend,
    layers,
    num_pages,
    page_size,
    heads,
    head_dim,
    head_dim_v,
    dtype,
    hs,
    nh,
    ns,
):  # type: ignore[no-untyped-def]
    """unpack(gate=...) (a checksum's verdict): a closed gate (0) changes no byte of any page; an
    open one (1) unpacks exactly what the ungated call does. Triton reads it inside the kernel."""
    if backend == "cpu" and DEVICE != "cpu":
        pytest.skip("the compiled CPU loop copies host pools")
    kw = _pool_kwargs(layers, num_pages, page_size, heads, head_dim, head_dim_v, dtype)
    src, dst, ref_dst = make_regions(**kw), make_regions(**kw), make_regions(**kw)
    for t, r in zip(dst.regions, ref_dst.regions, strict=True):
        r.reshape(-1).view(torch.uint8).copy_(t.reshape(-1).view(torch.uint8))
    pages_src, pages_dst = _pages(num_pages, num_pages // 2 + 1, 5), _pages(num_pages, num_pages // 2 + 1, 6)
    staging = reference.pack(src, pages_src, head_start=hs, num_heads=nh, num_slices=ns)
    call = dict(head_start=hs, num_heads=nh, num_slices=ns, backend=backend)
    before = snapshot(dst)
    closed = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    kernels.unpack(dst, staging, pages_dst, gate=closed, **call)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(dst), strict=True))
    kernels.unpack(dst, staging, pages_dst, gate=closed + 1, **call)
    reference.unpack(ref_dst, staging, pages_dst, head_start=hs, num_heads=nh, num_slices=ns)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(dst), snapshot(ref_dst), strict=True))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_empty_selection_is_a_no_op(make_regions, snapshot, backend):  # type: ignore[no-untyped-def]
    """Zero pages pack to zero bytes and unpack changes nothing."""
    pool = make_regions(device=DEVICE)
    before = snapshot(pool)
    out = kernels.pack(pool, np.array([], dtype=np.int64), backend=backend)
    assert out.numel() == 0
    kernels.unpack(pool, out, [], backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool), strict=True))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(pages=[0, 9]), "pages"),
        (dict(pages=[-1]), "pages"),
        (dict(pages=[1.5]), "pages"),
        (dict(pages=[[1]]), "pages"),
        (dict(pages=[1, 1]), "pages"),
        (dict(pages=[1], head_start=1, num_heads=2), "head_start"),
        (dict(pages=[1], num_slices=0), "num_slices"),
        (dict(pages=[1, 2], staging_bytes=10), "staging"),
    ],
)
def test_bad_calls_raise_and_change_nothing(make_regions, snapshot, kwargs, field):  # type: ignore[no-untyped-def]
    """Out-of-range/duplicate pages, bad head ranges and short staging raise InvalidArgument."""
    pool = make_regions(num_pages=9, device=DEVICE)
    before = snapshot(pool)
    staging = torch.zeros(kwargs.pop("staging_bytes", 1 << 16), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(InvalidArgument) as exc:
        kernels.unpack(pool, staging, backend="torch", **kwargs)
    assert exc.value.field == field
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool), strict=True))


@pytest.mark.parametrize("top", [40, 10**9], ids=["bitmap", "sort"])
def test_distinct_finds_a_repeat_either_way(top: int) -> None:
    """The destination-page check finds a repeated index out of order, marking a bitmap of the
    index range (small range) or sorting (large range)."""
    assert not distinct(np.array([7, 3, 30, 3, 12], dtype=np.int64), top)
    assert distinct(np.array([7, 3, 30, 4, 12], dtype=np.int64), top)
    assert distinct(np.arange(5, dtype=np.int64), top) and distinct(np.array([3], dtype=np.int64), top)


def test_regions_reject_wrong_sizes() -> None:
    """KVRegions.create names the region whose byte size does not match the geometry."""
    k = [torch.zeros(8, 2, 4), torch.zeros(9, 2, 4)]
    with pytest.raises(InvalidArgument) as exc:
        kernels.KVRegions.create(k, None, page_size=4, num_heads=2, head_dim_k=4)
    assert exc.value.field == "regions.k[1]"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pack_into_pinned_host_staging(make_regions) -> None:  # type: ignore[no-untyped-def]
    """On a GPU the kernel writes straight into pinned host staging and reads back from it."""
    src = make_regions(
        layers=3, num_pages=64, page_size=16, heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda"
    )
    pages = _pages(64, 33, 3)
    nbytes = kernels.packed_nbytes(src, 33, 4, 2)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    _triton.pack(src, pages, host, num_heads=4, num_slices=2)
    torch.cuda.synchronize()
    assert torch.equal(host, reference.pack(src, pages, num_heads=4, num_slices=2).cpu())


@pytest.mark.parametrize("layers,num_pages,page_size,heads,head_dim,head_dim_v,dtype,hs,nh,ns", SHAPES)
def test_compiled_cpu_pack_and_unpack_match_reference(
    make_regions, snapshot, layers, num_pages, page_size, heads, head_dim, head_dim_v, dtype, hs, nh, ns
):  # type: ignore[no-untyped-def]
    """The compiled CPU loop (the host path of "auto") packs the reference's bytes, and unpacks
    into exactly the reference's result: other pages and other heads untouched."""
    kw = _pool_kwargs(layers, num_pages, page_size, heads, head_dim, head_dim_v, dtype) | {"device": "cpu"}
    src, dst, ref_dst = make_regions(**kw), make_regions(**kw), make_regions(**kw)
    for t, r in zip(dst.regions, ref_dst.regions, strict=True):
        r.reshape(-1).view(torch.uint8).copy_(t.reshape(-1).view(torch.uint8))
    pages_src, pages_dst = _pages(num_pages, num_pages // 2 + 1, 3), _pages(num_pages, num_pages // 2 + 1, 4)
    want = reference.pack(src, pages_src, head_start=hs, num_heads=nh, num_slices=ns)
    got = kernels.pack(src, pages_src, head_start=hs, num_heads=nh, num_slices=ns, backend="cpu")
    assert torch.equal(got, want)
    before = snapshot(dst)
    kernels.unpack(dst, want, pages_dst, head_start=hs, num_heads=nh, num_slices=ns, backend="cpu")
    reference.unpack(ref_dst, want, pages_dst, head_start=hs, num_heads=nh, num_slices=ns)
    he = hs + ns * (nh or heads - hs)
    outside = np.setdiff1d(np.arange(num_pages), pages_dst)
    for g, w, b in zip(snapshot(dst), snapshot(ref_dst), before, strict=True):
        assert torch.equal(g, w)
        assert torch.equal(g[outside], b[outside])
        assert torch.equal(g[pages_dst][:, :, :hs], b[pages_dst][:, :, :hs])
        assert torch.equal(g[pages_dst][:, :, he:], b[pages_dst][:, :, he:])


def test_auto_takes_the_compiled_cpu_path_for_host_pools(make_regions, monkeypatch):  # type: ignore[no-untyped-def]
    """ "auto" on host tensors runs the compiled loop, not the reference (which would pass too)."""
    from kvservice.kernels import _pack_cpu

    pool = make_regions(layers=1, num_pages=8, page_size=4, heads=2, head_dim=8, device="cpu")
    calls: list[str] = []
    monkeypatch.setattr(reference, "pack", lambda *a, **k: calls.append("reference"))
    real = _pack_cpu.pack
    monkeypatch.setattr(_pack_cpu, "pack", lambda *a: (calls.append("cpu"), real(*a))[1])
    kernels.pack(pool, [1, 2])
    assert calls == ["cpu"]


def test_compiled_cpu_backend_refuses_device_tensors(make_regions):  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA pool to refuse")
    pool = make_regions(layers=1, num_pages=8, page_size=4, heads=2, head_dim=8, device="cuda")
    with pytest.raises(InvalidArgument, match="backend"):
        kernels.pack(pool, [1, 2], backend="cpu")
