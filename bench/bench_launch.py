"""Where a one-page same-node transfer's microseconds go on the GPU, piece by piece, in one process
(no service, no RPC): the floor the per-transfer path stands on (docs/decisions/0014 made it native).

    python bench/bench_launch.py --out /tmp/kvservice-bench        # on the GPU machine

Rows (p50/p99 µs over --iters, one page of 32 layers x K/V = 2 MiB, or --layers 1 = 64 KiB):
  launch_fused     copy_pages(...) returns (checks, pinned page table H2D, Triton launch), no wait
  fused_sync       launch + torch.cuda.synchronize()
  event_query_spin launch + record + query() in a Python loop (the old wait_event without sleeps)
  completion_loop  launch + record + await completions.done() under uvloop (the service's way now)
  pack_launch      kernels.pack(...) into a staging view, no wait
  empty_await      await of an already-set future under uvloop (the loop's own floor)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
from _harness import KVPool, summarize, write_json
from _same_node import _regions
from kvservice_client import Layout


def timeit(fn, iters: int) -> dict:  # type: ignore[no-untyped-def]
    xs = []
    for _ in range(iters + 5):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return summarize(xs[5:])


def main() -> None:
    import torch
    import uvloop

    from kvservice import kernels
    from kvservice.kernels import completions
    from kvservice.kernels.fused import copy_pages
    from kvservice.kernels.streams import service_stream

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--out", default="/tmp/kvservice-bench")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    lay = Layout.mha(
        num_layers=args.layers, page_size=16, num_pages=64, total_kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    ps, pd = KVPool(lay, 0, 1), KVPool(lay, 0, 2)
    rs, rd = _regions(lay, ps), _regions(lay, pd)
    sp, dp = np.array([3]), np.array([5])
    stream = service_stream(0)
    rows: dict[str, dict] = {}
    with torch.cuda.device(0), torch.cuda.stream(stream):
        copy_pages(rs, rd, sp, dp)
        torch.cuda.synchronize()
        rows["launch_fused"] = timeit(lambda: copy_pages(rs, rd, sp, dp), args.iters)
        torch.cuda.synchronize()

        def sync() -> None:
            copy_pages(rs, rd, sp, dp)
            torch.cuda.synchronize()

        rows["fused_sync"] = timeit(sync, args.iters)

        def spin() -> None:
            copy_pages(rs, rd, sp, dp)
            ev = torch.cuda.Event()
            ev.record(stream)
            while not ev.query():
                pass

        rows["event_query_spin"] = timeit(spin, args.iters)
        staging = torch.empty(lay.page_bytes_all_layers, dtype=torch.uint8, device="cuda:0")
        kernels.pack(rs, sp, staging)
        torch.cuda.synchronize()
        rows["pack_launch"] = timeit(lambda: kernels.pack(rs, sp, staging), args.iters)
        torch.cuda.synchronize()

    async def loop_rows() -> None:
        xs, ys = [], []
        for _ in range(args.iters + 5):
            t0 = time.perf_counter()
            with torch.cuda.device(0), torch.cuda.stream(stream):
                copy_pages(rs, rd, sp, dp)
                ev = torch.cuda.Event()
                ev.record(stream)
            await completions.done(ev, (0, "copy"))
            xs.append(time.perf_counter() - t0)
            fut = asyncio.get_running_loop().create_future()
            t0 = time.perf_counter()
            fut.set_result(None)
            await fut
            ys.append(time.perf_counter() - t0)
        rows["completion_loop"] = summarize(xs[5:])
        rows["empty_await"] = summarize(ys[5:])

    uvloop.run(loop_rows())
    completions.shutdown()
    for k, v in rows.items():
        print(f"{k:18s} p50 {v['p50_ms'] * 1e3:8.1f} us  p99 {v['p99_ms'] * 1e3:8.1f} us", file=sys.stderr)
    write_json(
        args.out,
        f"launch_gpu{args.tag}",
        {"benchmark": "launch", "bytes": lay.page_bytes_all_layers, "iters": args.iters, "rows": rows},
    )


if __name__ == "__main__":
    main()
