"""Where a pack launch's CPU time goes (GPU only): Triton's launch, our argument checks, the rest.

The cross-node 2 GiB layout (32 layers x K/V, 32 KiB pages) packed 1 and 128 pages at a time, as
the packed route does per batch; the median wall time of the ``kernels.pack`` call (the kernel is
asynchronous: this is the launching thread's cost), of Triton's ``JITFunction.run`` inside it,
and of ``check_copy`` alone. Prints one line per size::

    python3 bench/probe_launch_cost.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton.runtime.jit as jit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvservice import kernels  # noqa: E402
from kvservice.kernels import KVRegions  # noqa: E402
from kvservice.kernels._checks import check_copy  # noqa: E402


def main() -> None:
    dev = torch.device("cuda", 0)
    layers, pool_pages = 32, 2048
    shape = (pool_pages, 16, 8, 128)
    k = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    v = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    src = KVRegions.create(k, v, page_size=16, num_heads=8, head_dim_k=128)
    rng = np.random.default_rng(0)
    spent = {"run": 0.0, "n": 0}
    run = jit.JITFunction.run

    def timed_run(self, *a, **kw):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = run(self, *a, **kw)
        spent["run"] += time.perf_counter() - t0
        spent["n"] += 1
        return out

    jit.JITFunction.run = timed_run  # type: ignore[method-assign]

    def median_us(fn, reps: int = 200) -> float:  # type: ignore[no-untyped-def]
        ts = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            if i % 10 == 9:
                torch.cuda.synchronize()
        return float(np.median(ts) * 1e6)

    for n in (1, 128):
        pages = rng.choice(pool_pages, n, replace=False).astype(np.int64)
        staging = torch.empty(n * 32768 * 2 * layers, dtype=torch.uint8, device=dev)
        for _ in range(5):
            kernels.pack(src, pages, staging)
        torch.cuda.synchronize()
        spent.update(run=0.0, n=0)
        full = median_us(lambda p=pages, s=staging: kernels.pack(src, p, s))
        triton_us = spent["run"] / spent["n"] * 1e6
        checks = median_us(lambda p=pages, s=staging: check_copy(src, p, s, 0, None, 1, to_staging=True))
        print(
            f"{n} pages: pack call {full:.0f} us; Triton launch {triton_us:.0f}; "
            f"argument checks {checks:.0f}; our geometry and the rest {full - triton_us - checks:.0f}"
        )


if __name__ == "__main__":
    main()
