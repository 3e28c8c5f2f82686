"""Load and soak: many transfers in flight between two kvservice processes, every one checked.

    python bench/soak.py                                  # 100,000 transfers, 1,000 in flight
    python bench/soak.py --total 2000 --inflight 200      # the CI size (tests/test_soak.py)

Two services (``python -m kvservice``, NIXL over UCX on DRAM, ``same_host_route=off``: the
cross-node path) and one engine client on each (asyncio SDK, one session each). Each transfer
has a random size (1..``--max-pages`` pages), random source and destination pages drawn from
free lists, fresh random bytes in its source pages, and a random prefix the receiver "holds".
When both sides report a terminal state, the destination pages are compared byte for byte with
the bytes written (every layer, K and V). Lost = not DONE on both sides, corrupted = DONE but
different bytes. Every ``--sample-s`` the services' RSS and open file descriptors are read
from /proc; after the warm-up (the first ``--warmup`` fraction of transfers) they must stay
flat. The JSON result goes to ``--out`` (default /tmp/kvservice-bench/soak_cpu.json).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Services, summarize, write_json  # noqa: E402
from kvservice_client import AsyncClient, Layout, ShmKVPool  # noqa: E402

LAYOUT = Layout.mha(
    num_layers=2, page_size=4, num_pages=24_576, total_kv_heads=2, head_dim=16, dtype="float16"
)
RSS_SLACK_MB = 48.0  # allowed RSS drift after warm-up (allocator noise, the index, retained records)
FD_SLACK = 4


def _proc_usage(pid: int) -> tuple[float, int]:
    rss_kb = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


class Side:
    def __init__(self, address: str, name: str) -> None:
        self.kv = AsyncClient(address, client_name=name, timeout=60)
        self.pool = ShmKVPool.create(LAYOUT)
        self.free = list(np.random.default_rng(hash(name) & 0xFFFF).permutation(LAYOUT.num_pages))
        self.bs = ""
        self.waiters: dict[str, asyncio.Future[Any]] = {}

    async def start(self) -> None:
        self.bs = (
            await self.kv.register_buffers(LAYOUT, self.pool.k_regions, self.pool.v_regions)
        ).buffer_set_id
        self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        async for st in self.kv.watch(include_current=False):
            if st.terminal:
                fut = self.waiters.pop(st.transfer_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(st)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return [int(p) for p in out]

    def regions(self) -> list[np.ndarray]:
        return [self.pool.k(i) for i in range(LAYOUT.num_layers)] + [
            self.pool.v(i) for i in range(LAYOUT.num_layers)
        ]

    async def close(self) -> None:
        self.watcher.cancel()
        await self.kv.close()
        self.pool.close()


async def _one(
    a: Side, b: Side, peer: str, rng: np.random.Generator, max_pages: int, deadline_ms: int
) -> tuple[str, float]:
    n = int(rng.integers(1, max_pages + 1))
    prefix = int(rng.integers(0, n)) if rng.random() < 0.5 else 0
    while len(a.free) < n or len(b.free) < n - prefix:
        await asyncio.sleep(0.001)
    src, dst = a.take(n), b.take(n - prefix)
    delta = src[prefix:]
    want = []
    for reg in a.regions():
        reg[delta] = rng.integers(0, 256, (len(delta), reg.shape[1]), dtype=np.uint8)
        want.append(reg[delta].copy())
    tid = f"soak-{uuid.uuid4().hex[:12]}"
    loop = asyncio.get_running_loop()
    fa, fb = loop.create_future(), loop.create_future()
    a.waiters[tid], b.waiters[tid] = fa, fb
    t0 = time.perf_counter()
    try:
        await b.kv.expect_delta(tid, b.bs, prefix_pages=prefix, dst_page_indices=dst, deadline_ms=deadline_ms)
        await a.kv.send_delta(tid, a.bs, src_page_indices=src, peer_address=peer, deadline_ms=deadline_ms)
        sa, sb = await asyncio.wait_for(asyncio.gather(fa, fb), deadline_ms / 1000 + 10)
        took = time.perf_counter() - t0
        if (sa.state, sb.state) != ("DONE", "DONE"):
            return f"lost:{sa.state}/{sb.state}:{sa.error or sb.error}", took
        same = all(np.array_equal(reg[dst], w) for reg, w in zip(b.regions(), want, strict=True))
        return ("ok" if same else "corrupted"), took
    except Exception as exc:  # noqa: BLE001 - counted as lost, with the reason
        a.waiters.pop(tid, None)
        b.waiters.pop(tid, None)
        return f"lost:{type(exc).__name__}:{exc}", time.perf_counter() - t0
    finally:
        a.free += src
        b.free += dst


async def soak(
    total: int, inflight: int, max_pages: int, warmup: float, sample_s: float, deadline_ms: int
) -> dict[str, Any]:
    env = {"KVSERVICE_SAME_HOST_ROUTE": "off", "KVSERVICE_MAX_DEADLINE_MS": str(max(deadline_ms, 600_000))}
    with Services(2, env=env) as svcs:
        pids = [p.pid for p in svcs.procs]
        a, b = Side(svcs.addresses[0], "soak-a"), Side(svcs.addresses[1], "soak-b")
        await a.start()
        await b.start()
        rng = np.random.default_rng(20261123)
        outcomes: dict[str, int] = {}
        reasons: dict[str, int] = {}
        lat: list[float] = []
        samples: list[dict[str, Any]] = []
        done = 0
        sem = asyncio.Semaphore(inflight)
        t_start = time.perf_counter()

        async def sampler() -> None:
            while True:
                row: dict[str, Any] = {"t_s": round(time.perf_counter() - t_start, 2), "done": done}
                for i, pid in enumerate(pids):
                    row[f"rss_mb_{i}"], row[f"fds_{i}"] = _proc_usage(pid)
                samples.append(row)
                await asyncio.sleep(sample_s)

        async def run_one() -> None:
            nonlocal done
            async with sem:
                what, took = await _one(a, b, svcs.addresses[1], rng, max_pages, deadline_ms)
            kind = what.split(":", 1)[0]
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if kind != "ok":
                reasons[what[:200]] = reasons.get(what[:200], 0) + 1
            lat.append(took)
            done += 1
            if done % max(total // 20, 1) == 0:
                print(f"{done}/{total} {outcomes}", flush=True)

        sampling = asyncio.ensure_future(sampler())
        pending: set[asyncio.Task[None]] = set()
        for _ in range(total):
            if len(pending) >= inflight * 2:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            pending.add(asyncio.ensure_future(run_one()))
        await asyncio.gather(*pending)
        wall = time.perf_counter() - t_start
        await asyncio.sleep(sample_s)
        sampling.cancel()
        final = {"t_s": round(time.perf_counter() - t_start, 2), "done": done}
        for i, pid in enumerate(pids):
            final[f"rss_mb_{i}"], final[f"fds_{i}"] = _proc_usage(pid)
        samples.append(final)
        await a.close()
        await b.close()
    after = [s for s in samples if s["done"] >= warmup * total] or samples[-1:]
    drift = {
        f"rss_mb_{i}": max(s[f"rss_mb_{i}"] for s in after) - min(s[f"rss_mb_{i}"] for s in after)
        for i in range(2)
    } | {f"fds_{i}": max(s[f"fds_{i}"] for s in after) - min(s[f"fds_{i}"] for s in after) for i in range(2)}
    flat = all(drift[f"rss_mb_{i}"] <= RSS_SLACK_MB and drift[f"fds_{i}"] <= FD_SLACK for i in range(2))
    return {
        "total": total,
        "inflight": inflight,
        "max_pages": max_pages,
        "outcomes": outcomes,
        "lost": total - outcomes.get("ok", 0) - outcomes.get("corrupted", 0),
        "corrupted": outcomes.get("corrupted", 0),
        "failure_reasons": reasons,
        "wall_s": round(wall, 2),
        "transfers_per_s": round(total / wall, 1),
        "latency": summarize(lat),
        "after_warmup_drift": drift,
        "rss_fd_flat": flat,
        "slack": {"rss_mb": RSS_SLACK_MB, "fds": FD_SLACK},
        "samples": samples,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", type=int, default=100_000)
    ap.add_argument("--inflight", type=int, default=1_000)
    ap.add_argument("--max-pages", type=int, default=16)
    ap.add_argument(
        "--warmup", type=float, default=0.2, help="fraction of transfers before RSS/FDs must be flat"
    )
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--deadline-ms", type=int, default=120_000)
    ap.add_argument("--out", default="/tmp/kvservice-bench")
    ap.add_argument("--name", default="soak_cpu")
    ns = ap.parse_args()
    report = asyncio.run(soak(ns.total, ns.inflight, ns.max_pages, ns.warmup, ns.sample_s, ns.deadline_ms))
    path = write_json(ns.out, ns.name, report)
    print(
        f"{path}: {report['total']} transfers, lost {report['lost']}, corrupted {report['corrupted']}, "
        f"{report['transfers_per_s']}/s, p50 {report['latency'].get('p50_ms', 0):.1f} ms, "
        f"drift {report['after_warmup_drift']}, flat={report['rss_fd_flat']}"
    )
    return 0 if report["lost"] == 0 and report["corrupted"] == 0 and report["rss_fd_flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
