"""Sweep the fused copy kernel's launch shape against a device copy of the same bytes (GPU only).

The same-node 2 GiB row of bench_transfer (32 layers x K/V, 1,024 scattered pages of 32 KiB in
pools of 2,048 pages) with the kernel alone: no service. Every configuration and the baselines
are timed with CUDA events in this run; the fastest configuration is printed and recorded, so
the service's defaults (``kvservice/kernels/_fused_triton.py``) follow a measurement::

    python3 bench/sweep_fused.py --out /tmp/kvservice-bench   # writes sweep_fused_<gpu>.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvservice import kernels  # noqa: E402
from kvservice.kernels import KVRegions, _fused_triton  # noqa: E402
from kvservice.kernels.fused import check_fused  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _timer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--pool-pages", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="/tmp/kvservice-bench")
    ap.add_argument("--quick", action="store_true", help="a few configurations (smoke)")
    ap.add_argument(
        "--configs",
        default="",
        help="only these, comma list of block_words:num_warps:max_row_block:evict (evict '' or evict_first)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="time the grid this many times, interleaved")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    ps, heads, hd = 16, 8, 128
    shape = (args.pool_pages, ps, heads, hd)

    def pool() -> KVRegions:
        k = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
        v = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
        return KVRegions.create(k, v, page_size=ps, num_heads=heads, head_dim_k=hd)

    src, dst = pool(), pool()
    rng = np.random.default_rng(0)
    sp = rng.choice(args.pool_pages, args.pages, replace=False).astype(np.int64)
    dp = rng.choice(args.pool_pages, args.pages, replace=False).astype(np.int64)
    nbytes = args.pages * ps * heads * hd * 2 * 2 * args.layers
    a = check_fused(src, dst, sp, dp)
    flat_s = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    staging = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    timed = _timer(True, args.iters, 1)  # median ms over CUDA events, after one warm-up call
    base = {
        "copy": {"p50_ms": timed(lambda: flat_d.copy_(flat_s))},
        "pack": {"p50_ms": timed(lambda: kernels.pack(src, sp, staging))},
        "unpack": {"p50_ms": timed(lambda: kernels.unpack(dst, staging, dp))},
    }
    copy_ms = base["copy"]["p50_ms"]
    print(f"copy {copy_ms:.3f} ms  pack {base['pack']['p50_ms']:.3f}  unpack {base['unpack']['p50_ms']:.3f}")
    if args.configs:
        grid = [(int(b), int(w), int(r), e) for b, w, r, e in (c.split(":") for c in args.configs.split(","))]
    elif args.quick:
        grid = list(itertools.product([8192], [8], [64], ["", "evict_first"]))
    else:
        grid = list(itertools.product([4096, 8192, 16384, 32768], [4, 8, 16], [64, 256], ["", "evict_first"]))
    rows = []
    for bw, nw, rb, ev in grid * args.rounds:
        t0 = time.perf_counter()

        def run(bw=bw, nw=nw, rb=rb, ev=ev) -> None:
            _fused_triton.copy(src, dst, a, bw, nw, max_row_block=rb, evict=ev)

        try:
            st = {"p50_ms": timed(run)}
        except Exception as exc:  # a shape Triton cannot compile: recorded, not fatal
            rows.append(
                {
                    "block_words": bw,
                    "num_warps": nw,
                    "max_row_block": rb,
                    "evict": ev,
                    "error": str(exc)[:200],
                }
            )
            continue
        st.update(
            block_words=bw, num_warps=nw, max_row_block=rb, evict=ev, share_of_copy=copy_ms / st["p50_ms"]
        )
        st["compile_and_time_s"] = time.perf_counter() - t0
        rows.append(st)
        print(
            f"bw {bw:6d} warps {nw:2d} rb {rb:3d} {ev or '-':12s} "
            f"{st['p50_ms']:.3f} ms {st['share_of_copy']:.1%}"
        )
    ok = [r for r in rows if "error" not in r]
    best = min(ok, key=lambda r: r["p50_ms"])
    default = next(
        (
            r
            for r in ok
            if (r["block_words"], r["num_warps"], r["max_row_block"], r["evict"]) == (8192, 8, 64, "")
        ),
        None,
    )
    res = {
        "benchmark": "sweep_fused",
        "gpu": torch.cuda.get_device_name(0),
        "command": " ".join(["python3", *sys.argv]),
        "bytes": nbytes,
        "baselines": base,
        "default": default,
        "best": best,
        "rows": rows,
    }
    print("best", best, "default", default)
    name = "h200" if "H200" in res["gpu"] else "h100" if "H100" in res["gpu"] else "gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sweep_fused_{name}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
