"""Per-batch timeline of a 2 GiB scattered GPU transfer (diagnosis of the packed path).

    python bench/trace_packed_batches.py <vram_staging_mb> two   # two kvservice processes, NIXL between them
    python bench/trace_packed_batches.py <vram_staging_mb> one   # one kvservice per node (same-node path)

Engines are tests/gpu/gpu_engine.py processes (32 layers, 8 KV heads, head_dim 128, bf16, page 16,
2,048-page pools, 1,024 scattered pages = 2 GiB). Prints end-to-end time and phase sums per
transfer, then each packed batch's timeline (ms since the chunk was queued: queued, start,
slot held, packed, written, committed) from the services' DEBUG logs. ``bench_transfer.py
--timeline`` records and plots the same lines for any run.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
import numpy as np

from tests.gpu.test_cuda_ipc import Engine

MODE = sys.argv[2] if len(sys.argv) > 2 else "two"
tmp = tempfile.mkdtemp()
env = {
    **os.environ,
    "KVSERVICE_LOG_FORMAT": "json",
    "KVSERVICE_LOG_LEVEL": "DEBUG",
    "KVSERVICE_VRAM_STAGING_MB": sys.argv[1] if len(sys.argv) > 1 else "1024",
}
procs, socks = [], []
for n in ("a", "b"):
    sock = f"{tmp}/{n}.sock"
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "kvservice", "--uds-path", sock],
            env=env,
            stderr=open(f"{tmp}/{n}.log", "w"),
            stdout=subprocess.DEVNULL,
        )
    )
    socks.append("unix:" + sock)
for s in socks:
    while not os.path.exists(s[5:]):
        time.sleep(0.1)
L = dict(num_layers=32, page_size=16, num_pages=2048, total_kv_heads=8, head_dim=128, dtype="bfloat16")
src_e, dst_e = Engine(), Engine()
try:
    src_e(op="register", address=socks[0], layout=L, fill=True)
    dst_e(op="register", address=socks[1 if MODE == "two" else 0], layout=L)
    rng = np.random.default_rng(0)
    for it in range(4):
        src = rng.permutation(2048)[:1024].tolist()
        dst = rng.permutation(2048)[:1024].tolist()
        tid = f"t{it}"
        t0 = time.perf_counter()
        dst_e(op="expect", tid=tid, prefix=0, dst=dst)
        src_e(op="send", tid=tid, src=src, peer=socks[1 if MODE == "two" else 0])
        s = src_e(op="wait", tid=tid)
        d = dst_e(op="wait", tid=tid)
        print(
            it,
            "e2e %.1f ms" % ((time.perf_counter() - t0) * 1e3),
            s["state"],
            d["state"],
            "send",
            s["timings"],
            "recv",
            d["timings"],
            flush=True,
        )
finally:
    src_e.close()
    dst_e.close()
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait()
for n in ("a", "b"):
    for line in open(f"{tmp}/{n}.log"):
        if '"packed batch"' in line:
            d = json.loads(line)
            ms = [round((t - d["t"][0]) * 1e3, 3) for t in d["t"]]
            print(n, d["transfer_id"], d["bytes"] >> 20, "MiB", ms)
        elif "unpack" in line.lower() and "debug" in line.lower():
            pass
