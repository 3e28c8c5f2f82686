"""Cross-engine conversion cost: copies between pools of different page layouts and page sizes,
against the same-layout copy of the same bytes and a contiguous copy, in one run. (A page-1 pool
scatters every token: compare its cases with the page-1 to page-1 copy, which converts nothing.)
The cases (CASES) name every page layout as sender and as receiver and every page-size relation.
The goal: each at >= 80% of the same-layout fused rate (``below_goal`` lists the others).

Each case moves one sequence of ``--tokens`` tokens (every layer's K and V, scattered pages on both
sides) from a sender pool to a receiver pool, two ways: the fused pool-to-pool copy (same node) and
pack + unpack through staging (the cross-node path; the sender packs in the receiver's order).
GB/s counts the payload once. Baselines: the same route between two NHD pools of page 16 (no
conversion), and one contiguous ``copy_`` of the payload (the memory bandwidth bound).

    python bench/bench_convert.py                     # CPU: /tmp/kvservice-bench/convert_cpu.json
    python bench/bench_convert.py --device cuda       # GPU (Triton): convert_gpu.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import base_args, run_tag, write_json  # noqa: E402

from kvservice import kernels  # noqa: E402
from kvservice.kernels import KVRegions  # noqa: E402
from kvservice.kernels.fused import check_fused, copy_pages  # noqa: E402

# (sender layout, page) -> (receiver layout, page); the first is the baseline. A compact matrix:
# every page layout is a sender and a receiver at least once, and every page-size relation
# (equal, a smaller and a larger receiver page, page 1 on either side) appears. Engines' pools:
#   nhd     SGLang's token pool (page 1, or its page size 64) and vLLM's NHD blocks
#   hnd     vLLM's HND blocks (K and V planes apart)
#   hnd_kv  vLLM CPU [blocks, heads, block_size, K|V]
#   kv_nhd  FlashInfer [blocks, 2, block_size, heads, dim];  kv_hnd: its HND stride order
#   nhc     vLLM >= 0.32 GPU [blocks, block_size, heads, K|V] (LBNHC, the default);  hnc: LBHNC
CASES = [
    ("same layout (baseline)", ("nhd", 16), ("nhd", 16)),
    ("SGLang page 1 -> SGLang page 1 (no conversion)", ("nhd", 1), ("nhd", 1)),
    ("SGLang page 1 -> vLLM CPU block 16", ("nhd", 1), ("hnd_kv", 16)),
    ("SGLang page 64 -> vLLM CPU block 16", ("nhd", 64), ("hnd_kv", 16)),
    ("vLLM CPU block 16 -> SGLang page 1", ("hnd_kv", 16), ("nhd", 1)),
    ("SGLang page 1 -> vLLM NHD block 16", ("nhd", 1), ("nhd", 16)),
    ("vLLM HND block 16 -> HND block 32", ("hnd", 16), ("hnd", 32)),
    ("vLLM NHD block 16 -> HND block 16", ("nhd", 16), ("hnd", 16)),
    ("vLLM HND block 16 -> NHD block 16", ("hnd", 16), ("nhd", 16)),
    ("vLLM GPU NHC block 16 -> SGLang page 1", ("nhc", 16), ("nhd", 1)),
    ("SGLang page 1 -> vLLM GPU NHC block 16", ("nhd", 1), ("nhc", 16)),
    ("vLLM GPU NHC block 16 -> SGLang page 64", ("nhc", 16), ("nhd", 64)),
    ("vLLM CPU block 16 -> vLLM GPU NHC block 16", ("hnd_kv", 16), ("nhc", 16)),
    ("FlashInfer NHD block 16 -> FlashInfer HND block 16", ("kv_nhd", 16), ("kv_hnd", 16)),
    ("FlashInfer HND block 16 -> SGLang page 1", ("kv_hnd", 16), ("nhd", 1)),
    ("SGLang page 1 -> FlashInfer NHD block 16", ("nhd", 1), ("kv_nhd", 16)),
    ("vLLM GPU HNC block 32 -> FlashInfer NHD block 16", ("hnc", 32), ("kv_nhd", 16)),
    ("FlashInfer NHD block 16 -> vLLM GPU HNC block 16", ("kv_nhd", 16), ("hnc", 16)),
    ("vLLM GPU HNC block 16 -> vLLM HND block 64", ("hnc", 16), ("hnd", 64)),
]

# a layer's one region for the layouts that hold K and V together: the page's shape after pages
_ONE_REGION = {
    "hnd_kv": lambda page, heads, dim: (heads, 2 * page, dim),
    "kv_nhd": lambda page, heads, dim: (2, page, heads, dim),
    "kv_hnd": lambda page, heads, dim: (2, heads, page, dim),
    "nhc": lambda page, heads, dim: (page, heads, 2 * dim),
    "hnc": lambda page, heads, dim: (heads, page, 2 * dim),
}


def make_pool(
    layout: str, page: int, tokens: int, layers: int, heads: int, dim: int, device: str
) -> KVRegions:
    pages = 2 * math.ceil(tokens / page) + 8  # room for a scattered sequence
    dt = torch.float16
    geometry = dict(page_size=page, num_heads=heads, head_dim_k=dim, page_layout=layout)
    if layout in _ONE_REGION:
        inner = _ONE_REGION[layout](page, heads, dim)
        k = [torch.randn(pages, *inner, device=device).to(dt) for _ in range(layers)]
        return KVRegions.create(k, None, **geometry)  # type: ignore[arg-type]
    shape = (pages, page, heads, dim) if layout == "nhd" else (pages, heads, page, dim)
    k = [torch.randn(*shape, device=device).to(dt) for _ in range(layers)]
    v = [torch.randn(*shape, device=device).to(dt) for _ in range(layers)]
    return KVRegions.create(k, v, **geometry)  # type: ignore[arg-type]


def units(regions: KVRegions, tokens: int, g: int, rng: np.random.Generator) -> np.ndarray:
    """The sequence's units on scattered pages of ``regions``."""
    m = regions.page_size // g
    pages = rng.permutation(regions.num_pages)[: math.ceil(tokens / regions.page_size)]
    return (pages[:, None] * m + np.arange(m)[None, :]).reshape(-1)[: tokens // g].astype(np.int64)


def timed(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    base_args(ap)
    a = ap.parse_args()
    if a.small:
        a.tokens, a.layers, a.iters = 256, 4, 2
    device = "cpu" if a.device == "cpu" else f"cuda:{a.src_gpu}"
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    payload = a.tokens * a.layers * 2 * a.heads * a.head_dim * 2
    flat_src = torch.empty(payload, dtype=torch.uint8, device=device).random_(0, 255)
    flat_dst = torch.empty_like(flat_src)
    memcpy_s = timed(lambda: flat_dst.copy_(flat_src), a.iters, sync)
    rows = []
    base: dict[str, float] = {}
    for name, (sl, ps), (dl, pr) in CASES:
        rng = np.random.default_rng(0)
        src = make_pool(sl, ps, a.tokens, a.layers, a.heads, a.head_dim, device)
        dst = make_pool(dl, pr, a.tokens, a.layers, a.heads, a.head_dim, device)
        g = math.gcd(ps, pr)
        su, du = units(src, a.tokens, g, rng), units(dst, a.tokens, g, rng)
        staging = torch.empty(
            kernels.packed_nbytes(src, su.size, a.heads, unit=g), dtype=torch.uint8, device=device
        )
        fused_s = timed(lambda: copy_pages(src, dst, su, du, unit=g), a.iters, sync)  # noqa: B023
        check_s = timed(lambda: check_fused(src, dst, su, du, unit=g), a.iters, lambda: None)  # noqa: B023
        pack_s = timed(
            lambda: kernels.pack(src, su, staging, unit=g, head_major=dst.head_major),  # noqa: B023
            a.iters,
            sync,
        )
        unpack_s = timed(lambda: kernels.unpack(dst, staging, du, unit=g), a.iters, sync)  # noqa: B023
        row = {
            "case": name,
            "src": f"{sl} page {ps}",
            "dst": f"{dl} page {pr}",
            "unit_tokens": g,
            "payload_bytes": payload,
            "fused_ms": round(fused_s * 1e3, 3),
            "fused_gbps": round(payload / fused_s / 1e9, 2),
            "fused_check_ms": round(check_s * 1e3, 3),  # the host's argument check, inside fused_ms
            "pack_ms": round(pack_s * 1e3, 3),
            "unpack_ms": round(unpack_s * 1e3, 3),
            "pack_unpack_gbps": round(payload / (pack_s + unpack_s) / 1e9, 2),
        }
        if not base:
            base = {"fused": fused_s, "packed": pack_s + unpack_s}
        row["fused_vs_same_layout"] = round(base["fused"] / fused_s, 3)
        row["pack_unpack_vs_same_layout"] = round(base["packed"] / (pack_s + unpack_s), 3)
        row["fused_vs_memcpy"] = round(memcpy_s / fused_s, 3)
        rows.append(row)
        print(
            f"{name:52s} fused {row['fused_gbps']:7.2f} GB/s ({row['fused_vs_same_layout']:.2f}x same)  "
            f"pack+unpack {row['pack_unpack_gbps']:7.2f} GB/s ({row['pack_unpack_vs_same_layout']:.2f}x)"
        )
    result = {
        "benchmark": "convert",
        "command": "python bench/bench_convert.py " + " ".join(sys.argv[1:]),
        "tokens": a.tokens,
        "layers": a.layers,
        "heads": a.heads,
        "head_dim": a.head_dim,
        "dtype": "float16",
        "memcpy_gbps": round(payload / memcpy_s / 1e9, 2),
        "goal": "fused_vs_same_layout >= 0.8 for every case",
        "below_goal": [r["case"] for r in rows if r["fused_vs_same_layout"] < 0.8],
        "cases": rows,
    }
    path = write_json(a.out, f"convert_{run_tag(a)}", result)
    print(
        f"memcpy {result['memcpy_gbps']} GB/s; below 80% of same layout: {result['below_goal']}; wrote {path}"
    )


if __name__ == "__main__":
    main()
