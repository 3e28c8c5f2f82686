"""Run a kvservice under torch.profiler (CPU + CUDA activity) and write its Chrome trace on exit.

The bench harness starts services through this file when ``BENCH_TORCH_PROFILE_DIR`` is set:
every kernel and copy of the process (UCX's included, through CUPTI) with GPU start and end, to
place a transfer's stages on the device's clock (``bench/trace_gpu.py`` reads the traces).
"""

from __future__ import annotations

import os
import runpy
import sys

from torch.profiler import ProfilerActivity, profile


def main() -> None:
    out = os.environ["BENCH_TORCH_PROFILE_DIR"]
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    try:
        sys.argv = ["kvservice", *sys.argv[1:]]
        runpy.run_module("kvservice", run_name="__main__")
    finally:
        prof.stop()
        prof.export_chrome_trace(os.path.join(out, f"svc-{os.getpid()}.json"))


if __name__ == "__main__":
    main()
