"""Summarise the services' torch.profiler traces (``BENCH_TORCH_PROFILE_DIR``): GPU kernels and
copies with their start, duration and stream, per process, as one CSV-like table on stdout.

    python3 bench/trace_gpu.py DIR [--last-ms 40]    # the last 40 ms of GPU activity of all traces
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--last-ms", type=float, default=40.0)
    args = ap.parse_args()
    rows = []
    for f in sorted(Path(args.dir).glob("svc-*.json")):
        d = json.loads(f.read_text())
        base = int(d.get("baseTimeNanoseconds", 0))
        for e in d.get("traceEvents", []):
            if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            ts = base / 1e3 + float(e["ts"])  # microseconds, one epoch for every trace
            rows.append(
                (ts, float(e["dur"]), f.stem, e["cat"], e.get("args", {}).get("stream"), e["name"][:60])
            )
    if not rows:
        print("no GPU activity in", args.dir)
        return
    rows.sort()
    end = max(r[0] + r[1] for r in rows)
    t0 = end - args.last_ms * 1e3
    rows = [r for r in rows if r[0] >= t0]
    first = rows[0][0]
    print("start_ms,dur_ms,proc,cat,stream,name")
    for ts, dur, proc, cat, stream, name in rows:
        print(f"{(ts - first) / 1e3:.3f},{dur / 1e3:.3f},{proc},{cat},{stream},{name}")


if __name__ == "__main__":
    main()
