"""Pack/unpack bandwidth against plain copies of the same bytes, in one run.

GB/s counts the payload once (bytes packed or unpacked). Baselines: a device-to-device
``copy_`` of the payload (VRAM staging) and a plain D2H/H2D ``copy_`` between a device buffer
and pinned host memory (host staging). Goals: >= 85% of D2D copy into VRAM staging, >= 90%
of the PCIe copy into pinned host staging.

    python bench/bench_kernels.py                  # GPU: writes /tmp/kvservice-bench/kernels_<gpu>.json
    python bench/bench_kernels.py --cpu --small    # CI smoke: torch reference on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvservice import kernels  # noqa: E402
from kvservice.kernels import KVRegions, packed_nbytes  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layers: int
    pool_pages: int
    pages: int
    page_size: int
    heads: int
    head_dim: int
    mla: bool = False
    head_start: int = 0
    num_heads: int | None = None
    num_slices: int = 1


@dataclasses.dataclass(frozen=True)
class Result:
    case: str
    op: str
    payload_bytes: int
    ms: float
    gbps: float
    baseline: str
    baseline_ms: float
    baseline_gbps: float
    ratio: float


def _cases(small: bool) -> list[Case]:
    if small:
        return [Case("mha-small", 2, 64, 17, 16, 8, 64), Case("mla-small", 2, 64, 17, 16, 1, 576, mla=True)]
    full = dict(layers=32, pool_pages=16384, pages=1024, page_size=16, heads=8, head_dim=128)
    return [
        Case("mha-8h-hd128", **full),  # type: ignore[arg-type]
        Case("mha-slices-2x4h", **full, num_heads=4, num_slices=2),  # type: ignore[arg-type]
        Case("mha-slice-2of8h", **full, head_start=2, num_heads=2),  # type: ignore[arg-type]
        Case("mla-576", 32, 16384, 1024, 16, 1, 576, mla=True),
    ]


def _timer(cuda: bool, iters: int, warmup: int) -> Callable[[Callable[[], object]], float]:
    def run(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def _regions(c: Case, dev: str, dtype: torch.dtype) -> KVRegions:
    shape = (c.pool_pages * c.page_size, c.heads, c.head_dim)
    k = [torch.empty(shape, dtype=dtype, device=dev) for _ in range(c.layers)]
    v = [] if c.mla else [torch.empty(shape, dtype=dtype, device=dev) for _ in range(c.layers)]
    for t in k + v:
        t.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return KVRegions.create(k, v, page_size=c.page_size, num_heads=c.heads, head_dim_k=c.head_dim)


def bench_case(
    c: Case, dev: str, timer: Callable[[Callable[[], object]], float], backend: str
) -> list[Result]:
    cuda = dev == "cuda"
    stage_kind = "vram" if cuda else "host"
    regions = _regions(c, dev, torch.bfloat16)
    pages = np.random.default_rng(0).permutation(c.pool_pages)[: c.pages].astype(np.int64)
    kw = dict(head_start=c.head_start, num_heads=c.num_heads, num_slices=c.num_slices, backend=backend)
    nh = c.heads - c.head_start if c.num_heads is None else c.num_heads
    nbytes = packed_nbytes(regions, c.pages, nh, c.num_slices)
    stage = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    copy_src = torch.empty_like(stage)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    ref = kernels.reference.pack(
        regions, pages, head_start=c.head_start, num_heads=c.num_heads, num_slices=c.num_slices
    )
    kernels.pack(regions, pages, stage, **kw)  # type: ignore[arg-type]
    assert torch.equal(stage, ref), f"{c.name}: pack differs from the reference"
    del ref
    d2d = timer(lambda: stage.copy_(copy_src))
    d2h = timer(lambda: host.copy_(copy_src, non_blocking=True))
    h2d = timer(lambda: copy_src.copy_(host, non_blocking=True))
    ops = [
        (f"pack->{stage_kind}", lambda: kernels.pack(regions, pages, stage, **kw), "d2d copy", d2d),  # type: ignore[arg-type]
        (f"unpack<-{stage_kind}", lambda: kernels.unpack(regions, stage, pages, **kw), "d2d copy", d2d),  # type: ignore[arg-type]
    ]
    if cuda:
        # Launch only (checks done once): separates the kernel from per-call host overhead.
        from kvservice.kernels import _triton
        from kvservice.kernels._checks import check_copy

        geo = (c.head_start, c.num_heads, c.num_slices)
        pa = check_copy(regions, pages, stage, *geo, to_staging=True)
        ua = check_copy(regions, pages, stage, *geo, to_staging=False)
        bw = _triton._BLOCK_WORDS
        ops += [
            ("pack->vram/launch", lambda: _triton._launch(regions, pa, True, bw, 8), "d2d copy", d2d),
            ("unpack<-vram/launch", lambda: _triton._launch(regions, ua, False, bw, 8), "d2d copy", d2d),
            ("pack->pinned", lambda: kernels.pack(regions, pages, host, **kw), "d2h copy", d2h),  # type: ignore[arg-type]
            ("unpack<-pinned", lambda: kernels.unpack(regions, host, pages, **kw), "h2d copy", h2d),  # type: ignore[arg-type]
        ]
    out = []
    for op, fn, base, base_ms in ops:
        ms = timer(fn)
        gb = nbytes / 1e9
        out.append(
            Result(c.name, op, nbytes, ms, gb / ms * 1e3, base, base_ms, gb / base_ms * 1e3, base_ms / ms)
        )
    return out


def sweep(c: Case, timer: Callable[[Callable[[], object]], float]) -> list[dict[str, object]]:
    """Triton launch parameters for the main shape (VRAM staging), to pick the defaults."""
    from kvservice.kernels import _triton

    regions = _regions(c, "cuda", torch.bfloat16)
    pages = np.random.default_rng(0).permutation(c.pool_pages)[: c.pages].astype(np.int64)
    stage = torch.empty(packed_nbytes(regions, c.pages, c.heads), dtype=torch.uint8, device="cuda")
    rows: list[dict[str, object]] = []
    for block_words in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            p = timer(
                functools.partial(
                    _triton.pack, regions, pages, stage, block_words=block_words, num_warps=warps
                )
            )
            u = timer(
                functools.partial(
                    _triton.unpack, regions, stage, pages, block_words=block_words, num_warps=warps
                )
            )
            rows.append(
                dict(
                    block_words=block_words,
                    num_warps=warps,
                    pack_ms=p,
                    unpack_ms=u,
                    pack_gbps=stage.numel() / p / 1e6,
                    unpack_gbps=stage.numel() / u / 1e6,
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on CPU with the torch reference")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CI smoke)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="also sweep Triton block/warps (GPU)")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default /tmp/kvservice-bench/kernels_<gpu>.json)"
    )
    args = ap.parse_args()
    cuda = not args.cpu and torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    backend = "triton" if cuda else "torch"
    timer = _timer(cuda, args.iters, args.warmup)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    results: list[Result] = []
    for c in _cases(args.small):
        results += bench_case(c, dev, timer, backend)
        if cuda:
            torch.cuda.empty_cache()
    report: dict[str, object] = dict(
        device=device_name,
        torch=torch.__version__,
        backend=backend,
        iters=args.iters,
        warmup=args.warmup,
        results=[dataclasses.asdict(r) for r in results],
    )
    if cuda and args.sweep:
        report["sweep"] = sweep(_cases(False)[0], timer)
    slug = "".join(ch if ch.isalnum() else "_" for ch in device_name.lower()).strip("_")
    path = args.out or Path("/tmp/kvservice-bench") / f"kernels_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{device_name} ({backend}); payload GB/s, median of {args.iters}")
    print(f"{'case':18} {'op':19} {'MiB':>8} {'ms':>8} {'GB/s':>8} {'baseline':>9} {'GB/s':>8} {'ratio':>6}")
    for r in results:
        print(
            f"{r.case:18} {r.op:19} {r.payload_bytes / 2**20:8.1f} {r.ms:8.3f} {r.gbps:8.1f} "
            f"{r.baseline:>9} {r.baseline_gbps:8.1f} {r.ratio:6.2f}"
        )
    for row in report.get("sweep", []):  # type: ignore[attr-defined]
        print("sweep", row)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
