"""Prefix index benchmark: MatchPrefix latency (hashing included), lookups/s, bytes per page.

    .venv/bin/python bench/bench_index.py [--pages 1000000] [--iters 300]

Writes ``/tmp/kvservice-bench/index-<host>-<date>.json``. ``grpc_match_prefix`` adds the through-gRPC
number when ``kvservice.server.app.build_server`` is importable (a running server in-process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import resource
import time
from collections.abc import Callable

import numpy as np
from kvservice_client.hashing import page_hashes, page_hashes_reference

from kvservice.index import PrefixIndex

PAGE_SIZE = 16
PROMPT_TOKENS = 131_072
RESULTS = pathlib.Path("/tmp/kvservice-bench")


def percentiles(samples_s: list[float]) -> dict[str, float]:
    a = np.array(samples_s) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "n": len(a)}


def timed(fn: Callable[[], object], iters: int) -> list[float]:
    fn()  # warm-up (numba compile / caches)
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def build_index(total_pages: int, rng: np.random.Generator) -> tuple[PrefixIndex, list[bytes]]:
    """One buffer set of ``total_pages`` pages filled by 8,192-page prompts; returns the prompts."""
    ix = PrefixIndex()
    ix.add_buffer_set("bs0", engine_id="e0", page_size=PAGE_SIZE, num_pages=total_pages)
    prompts, start = [], 0
    per = PROMPT_TOKENS // PAGE_SIZE
    while start < total_pages:
        n = min(per, total_pages - start)
        tokens = rng.integers(0, 150_000, n * PAGE_SIZE, dtype=np.uint32).astype("<u4").tobytes()
        ix.publish("bs0", page_hashes(tokens, PAGE_SIZE), np.arange(start, start + n))
        prompts.append(tokens)
        start += n
    return ix, prompts


def bench(total_pages: int, iters: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    ix, prompts = build_index(total_pages, rng)
    build_s = time.perf_counter() - t
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    st = ix.stats()
    prompt = prompts[0]  # a full hit: the worst case (every page found)
    miss = rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.uint32).astype("<u4").tobytes()
    hashes = page_hashes(prompt, PAGE_SIZE)

    def match_tokens(tokens: bytes = prompt) -> object:
        return ix.match(page_hashes(tokens, PAGE_SIZE), page_size=PAGE_SIZE)

    assert ix.match(hashes, page_size=PAGE_SIZE)[0].matched_pages == hashes.size
    out: dict[str, object] = {
        "match_prefix_131072_tokens_full_hit": percentiles(timed(match_tokens, iters)),
        "match_prefix_131072_tokens_miss": percentiles(timed(lambda: match_tokens(miss), iters)),
        "match_only_8192_hashes": percentiles(timed(lambda: ix.match(hashes, page_size=PAGE_SIZE), iters)),
        "match_scores_only_8192_hashes": percentiles(
            timed(lambda: ix.match(hashes, page_size=PAGE_SIZE, scores_only=True), iters)
        ),
        "hash_only_131072_tokens": percentiles(timed(lambda: page_hashes(prompt, PAGE_SIZE), iters)),
        "hash_python_loop_131072_tokens": percentiles(
            timed(lambda: page_hashes_reference(prompt, PAGE_SIZE), 20)
        ),
    }
    # Lookups/s: every page of random indexed prompts, 8,192-page walks over the 1M-page table.
    picks = [page_hashes(prompts[i], PAGE_SIZE) for i in rng.integers(0, len(prompts), 16)]
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < 2.0:
        for h in picks:
            n += ix.match(h, page_size=PAGE_SIZE)[0].matched_pages
    out["page_lookups_per_s"] = n / (time.perf_counter() - t)
    short = [h[:8] for h in picks]  # router-style short queries: calls/s
    t, calls = time.perf_counter(), 0
    while time.perf_counter() - t < 1.0:
        for h in short:
            ix.match(h, page_size=PAGE_SIZE, scores_only=True)
            calls += 1
    out["match_calls_per_s_8_pages"] = calls / (time.perf_counter() - t)
    out["indexed_pages"] = st.entries
    out["index_bytes_per_page"] = st.bytes_used / st.entries
    out["rss_bytes_per_page"] = (rss1 - rss0) * 1024 / st.entries  # ru_maxrss is KiB on Linux
    out["build_s"] = build_s
    out["grpc_match_prefix"] = grpc_match_prefix(iters)
    return out


def grpc_match_prefix(iters: int) -> dict[str, object] | str:
    """MatchPrefix of a 131,072-token prompt (8,192 pages, all held) through gRPC over the UDS.

    A real ``python -m kvservice`` process; the client sends the token ids (packed u32) and the
    service hashes them, walks the index and returns 8,192 page indices.
    """
    import subprocess
    import sys
    import tempfile

    from kvservice_client import Client, Layout, ShmKVPool

    sock = pathlib.Path(tempfile.mkdtemp(prefix="kvs-bench-")) / "kv.sock"
    env = {**os.environ, "KVSERVICE_LOG_LEVEL": "WARNING", "KVSERVICE_TRANSPORT": "loopback"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvservice", "--uds-path", str(sock)], env=env, stdout=subprocess.DEVNULL
    )
    layout = Layout.mha(
        num_layers=1,
        page_size=PAGE_SIZE,
        num_pages=PROMPT_TOKENS // PAGE_SIZE,
        total_kv_heads=1,
        head_dim=8,
        dtype="float16",
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                return "skipped: service did not start"
            time.sleep(0.05)
        tokens = np.random.default_rng(1).integers(0, 2**31, PROMPT_TOKENS, dtype=np.uint32)
        with ShmKVPool.create(layout) as pool, Client(f"unix:{sock}") as kv:
            bs = kv.register_buffers(layout, pool.k_regions, pool.v_regions).buffer_set_id
            kv.publish_pages(bs, np.arange(layout.num_pages), tokens=tokens)
            for _ in range(20):
                kv.match_prefix(tokens=tokens, page_size=PAGE_SIZE)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                m = kv.match_prefix(tokens=tokens, page_size=PAGE_SIZE)
                times.append((time.perf_counter() - t0) * 1e3)
            assert m.best is not None and m.best.matched_pages == layout.num_pages
        return {
            "p50_ms": float(np.percentile(times, 50)),
            "p99_ms": float(np.percentile(times, 99)),
            "n": iters,
        }
    finally:
        proc.terminate()
        proc.wait(20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    res = {
        "bench": "index",
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "page_size": PAGE_SIZE,
        "prompt_tokens": PROMPT_TOKENS,
        "results": bench(args.pages, args.iters),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"index-{platform.node()}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
