"""Transport bandwidth between two processes: one big descriptor vs many small ones.

    .venv/bin/python bench/bench_transport.py [--pages 8192] [--page-kib 32] [--iters 5]

Moves ``pages * page_kib`` KiB from this process into a spawned receiver with NIXL as
(a) one descriptor, (b) ``pages`` prepped descriptors scattered on the receiver (no merging
possible), (c) ``pages`` prepped descriptors contiguous on both sides (NIXL merges them), and
times (d) one local gather copy of the same bytes with torch (the pack cost of the packed path).
Prints a table and writes JSON under ``--out`` (default /tmp/kvservice-bench).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvservice.transfer.descriptors import fit_calibration, prepped_rows
from kvservice.transfer.nixl_transport import NixlTransport
from kvservice.transfer.transport import Transport, XferHandle


def _receiver(nbytes: int, up: Any, down: Any) -> None:
    t = NixlTransport("bench-rx")
    pool = np.zeros(nbytes, dtype=np.uint8)
    t.register(pool.ctypes.data, pool.nbytes, "DRAM", 0)
    up.put((t.metadata(), pool.ctypes.data))
    down.get()  # until the sender is done
    t.close()


def _settle(t: Transport, h: XferHandle) -> None:
    while t.status(h) == "PROC":
        pass
    t.release(h)


def _time(fn: Any, iters: int) -> float:
    fn()  # warm-up: connection set-up and first-touch
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=8192)
    ap.add_argument("--page-kib", type=int, default=32)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="/tmp/kvservice-bench")
    args = ap.parse_args()
    pb, n = args.page_kib * 1024, args.pages
    nbytes = pb * n
    ctx = mp.get_context("spawn")
    up, down = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver, args=(nbytes, up, down), daemon=True)
    child.start()
    t = NixlTransport("bench-tx")
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    t.register(src.ctypes.data, nbytes, "DRAM", 0)
    meta, rbase = up.get(timeout=60)
    t.add_peer("bench-rx", meta)
    one_l = t.prep_local(np.array([[src.ctypes.data, nbytes, 0]]))
    one_r = t.prep_remote("bench-rx", np.array([[rbase, nbytes, 0]]))
    pages_l = t.prep_local(prepped_rows(np.array([src.ctypes.data]), pb, n))
    pages_r = t.prep_remote("bench-rx", prepped_rows(np.array([rbase]), pb, n))
    ident = np.arange(n, dtype=np.int32)
    scattered = np.random.default_rng(1).permutation(n).astype(np.int32)
    zero = np.zeros(1, dtype=np.int32)
    results = {
        "one_descriptor": _time(lambda: _settle(t, t.write(one_l, zero, one_r, zero)), args.iters),
        "scattered_descriptors": _time(
            lambda: _settle(t, t.write(pages_l, ident, pages_r, scattered)), args.iters
        ),
        "contiguous_descriptors": _time(
            lambda: _settle(t, t.write(pages_l, ident, pages_r, ident)), args.iters
        ),
    }
    down.put(None)
    child.join(timeout=30)
    t.close()
    # NOTE: timed after both agents are gone: their progress threads spin and would steal the CPU.
    staging = torch.empty((n, pb), dtype=torch.uint8)
    view, perm = torch.from_numpy(src.reshape(n, pb)), torch.from_numpy(scattered.astype(np.int64))
    results["local_gather_copy"] = _time(lambda: torch.index_select(view, 0, perm, out=staging), args.iters)
    cal = fit_calibration(
        results["one_descriptor"], results["scattered_descriptors"], n, nbytes, results["local_gather_copy"]
    )
    report = {
        "ucx_tls": os.environ.get("UCX_TLS", "(unset)"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "bytes": nbytes,
        "descriptors": n,
        "page_bytes": pb,
        "median_s": results,
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in results.items()},
        "calibration": cal.__dict__,
    }
    print(f"{nbytes / 2**20:.0f} MiB, UCX_TLS={report['ucx_tls']}, median of {args.iters}")
    for k, v in results.items():
        print(f"  {k:24s} {v * 1e3:9.2f} ms  {nbytes / v / 1e9:7.2f} GB/s")
    print(f"  calibration: {cal}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = os.environ.get("UCX_TLS", "default").replace(",", "-")
    (out / f"transport_{tag}_{n}x{args.page_kib}k.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
