"""Mixed TP (2→1, 1→2, 4→2): kvservice vs per-token head-slice descriptors (SGLang's
``send_kvcache_slice`` pattern: one descriptor per token per layer per K/V per sender→receiver
rank pair, covering that pair's heads), same layout and pages, one run.

    .venv/bin/python bench/bench_mixed_tp.py --device cpu [--small]
    python bench/bench_mixed_tp.py --device cuda [--src-gpu 0 --dst-gpu 1]
    python bench/bench_mixed_tp.py --device cuda --pages 1024 --pool-pages 1088 --configs 4:2,2:1 \
        --skip-per-token --same-node --tag 2g_lane   # goal: 2 GiB >= 80% of a device copy

``--same-node``: one service serves every rank (one service per node, as deployed), so each
sender rank's SendDelta takes the native lane's head-slice copy; without it two services on this
host (the sender's fuses into the receiver's pools over CUDA IPC / shm, or ``--cross-node``).

Each run also times a contiguous copy of the moved bytes between the two devices (the same-run
baseline of the goal: ``fraction_of_contiguous_copy`` per config).

Sender ranks run as parallel processes in the baseline (a round ends when the slowest is done);
in kvservice every rank is a buffer set of the sender's service and a transfer ends when every
receiver rank is DONE.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _harness import (
    KVPool,
    Services,
    base_args,
    devices,
    network,
    progress,
    route_env,
    run_tag,
    summarize,
    write_json,
)
from _rawnixl import Job, run_raw
from _same_node import contiguous_copy
from kvservice_client import Client, Layout

#  Head slices for total heads H, sender TP p, receiver TP d (example H=8, p=4, d=2):
#    sender rank s holds heads [s*H/p, (s+1)*H/p)      s=0: 0-1  s=1: 2-3  s=2: 4-5  s=3: 6-7
#    receiver rank r holds [r*H/d, (r+1)*H/d)           r=0: 0-3             r=1: 4-7
#  pair (s, r) moves the overlap, per token: src offset (lo - s*H/p)*hb, dst offset (lo - r*H/d)*hb.


def pairs(H: int, p: int, d: int) -> list[tuple[int, int, int, int]]:
    """(s, r, lo, hi) for every sender/receiver rank pair whose heads overlap."""
    out = []
    for s in range(p):
        for r in range(d):
            lo, hi = max(s * H // p, r * H // d), min((s + 1) * H // p, (r + 1) * H // d)
            if lo < hi:
                out.append((s, r, lo, hi))
    return out


def baseline_jobs(
    args: argparse.Namespace, p: int, d: int, src: np.ndarray, dst: np.ndarray
) -> dict[int, list[Job]]:
    H, hb, ps, R = args.heads, args.head_dim * 2, args.page_size, 2 * args.layers
    tokens = args.pool_pages * ps
    tb_s, tb_d = H // p * hb, H // d * hb  # bytes per token of one region, sender / receiver rank
    tok_src = (src[:, None] * ps + np.arange(ps)).reshape(-1)
    tok_dst = (dst[:, None] * ps + np.arange(ps)).reshape(-1)
    r_idx = np.arange(R, dtype=np.int64)[:, None]
    jobs: dict[int, list[Job]] = {s: [] for s in range(p)}
    for s, r, lo, hi in pairs(H, p, d):
        n = (hi - lo) * hb
        one = np.ones(R, dtype=np.int64)
        lrows = np.stack(
            [
                np.arange(R) * tokens * tb_s + (lo - s * H // p) * hb,
                n * one,
                0 * one,
                tb_s * one,
                tokens * one,
            ],
            1,
        )
        rrows = np.stack(
            [
                np.arange(R) * tokens * tb_d + (lo - r * H // d) * hb,
                n * one,
                0 * one,
                tb_d * one,
                tokens * one,
            ],
            1,
        )
        li = (r_idx * tokens + tok_src[None, :]).reshape(-1).astype(np.int32)
        ri = (r_idx * tokens + tok_dst[None, :]).reshape(-1).astype(np.int32)
        jobs[s].append(Job(r, lrows, rrows, li, ri))
    return jobs


def layout(args: argparse.Namespace, tp: int, rank: int) -> Layout:
    return Layout.mha(
        num_layers=args.layers,
        page_size=args.page_size,
        num_pages=args.pool_pages,
        total_kv_heads=args.heads,
        head_dim=args.head_dim,
        dtype="bfloat16",
        tp_size=tp,
        tp_rank=rank,
    )


def kvservice_run(
    args: argparse.Namespace, svc: Services, p: int, d: int, src: np.ndarray, dst: np.ndarray
) -> dict:
    sdev, ddev = devices(args)
    a, b = svc.addresses[0], svc.addresses[-1]
    peer = svc.peer_addresses[-1]
    tx = [KVPool(layout(args, p, s), sdev, 10 + s) for s in range(p)]
    rx = [KVPool(layout(args, d, r), ddev, None) for r in range(d)]
    samples, phases, err, stats = [], [], "", []
    try:
        with Client(a, client_name="bench-tx") as ka, Client(b, client_name="bench-rx") as kb:
            sb = [ka.register_buffers(pl.layout, *pl.regions()).buffer_set_id for pl in tx]
            rb = [kb.register_buffers(pl.layout, *pl.regions()).buffer_set_id for pl in rx]
            for it in progress(range(args.iters + 1), f"kvservice {p}->{d}"):
                tid = f"tp{p}{d}-{it}"
                for bs in rb:
                    kb.expect_delta(
                        tid,
                        bs,
                        prefix_pages=0,
                        dst_page_indices=dst,
                        expected_senders=max(1, p // d),
                        sender_address=svc.peer_addresses[0],  # as the adapters do
                    )
                t0 = time.perf_counter()
                for bs in sb:
                    ka.send_delta(tid, bs, src_page_indices=src, peer_address=peer)
                try:
                    rst = kb.wait(tid, timeout=60)
                    dt = time.perf_counter() - t0
                    stats = ka.wait(tid, timeout=60)
                except Exception as exc:  # keep the other configs' numbers
                    err = f"{type(exc).__name__}: {exc}"
                    break
                bad = [s for s in rst + stats if s.state != "DONE"]
                if bad:
                    err = "; ".join(f"{s.role} {s.state} {s.error!r}" for s in bad)
                    break
                if it:
                    samples.append(dt)
                    phases.append(
                        {
                            k: max(s.timings_us.get(k, 0) for s in stats)
                            for k in ("plan", "pack", "wire", "total")
                        }
                    )
            lane = ka.lane_sent
            for bs in rb:
                kb.unregister_buffers(bs)
            for bs in sb:
                ka.unregister_buffers(bs)
        out: dict = {"error": err} if err else {}
        if samples:
            out.update(
                summarize(samples),
                samples_ms=[x * 1e3 for x in samples],
                paths=sorted({s.path for s in stats}),
                routes=sorted({s.route_note or "grpc" for s in stats}),
                lane_sent=lane,
                descriptors=sum(s.descriptors for s in stats),
                bytes_sent=sum(s.bytes_sent for s in stats),
                phases_us_median={k: float(np.median([q[k] for q in phases])) for k in phases[0]},
                verified=verify(args, tx, rx, p, d, src, dst),
            )
        return out
    finally:
        for pl in tx + rx:
            pl.close()


def verify(
    args: argparse.Namespace,
    tx: list[KVPool],
    rx: list[KVPool],
    p: int,
    d: int,
    src: np.ndarray,
    dst: np.ndarray,
) -> bool:
    """Global head g of page src[0] (layer 0, K) equals receiver's page dst[0] at its local head."""
    H, hb, ps = args.heads, args.head_dim * 2, args.page_size

    def head(pool: KVPool, page: int, h: int, local: int) -> bytes:
        t = pool.k(0)[int(page)]
        t = t.cpu().numpy() if hasattr(t, "cpu") else t
        return bytes(t.reshape(ps, local, hb)[:, h].tobytes())

    return all(
        head(tx[g // (H // p)], src[0], g % (H // p), H // p)
        == head(rx[g // (H // d)], dst[0], g % (H // d), H // d)
        for g in range(H)
    )


def one_config(
    args: argparse.Namespace,
    svc: Services,
    p: int,
    d: int,
    src: np.ndarray,
    dst: np.ndarray,
    full_bytes: int,
    copy_ms: float,
) -> dict:
    key = f"{p}->{d}"
    entry: dict = {}
    if not args.skip_per_token:
        entry["raw_nixl_per_token"] = per_token(args, p, d, src, dst)
    kv = kvservice_run(args, svc, p, d, src, dst)
    print(f"{key} kvservice: {kv.get('p50_ms', float('nan')):.2f} ms {kv.get('error', '')}", file=sys.stderr)
    entry["kvservice"] = kv
    for x in entry.values():
        if "p50_ms" in x:
            x["gb_per_s"] = full_bytes / (x["p50_ms"] * 1e-3) / 1e9
    if "p50_ms" in kv and "raw_nixl_per_token" in entry:
        entry["speedup_vs_per_token"] = entry["raw_nixl_per_token"]["p50_ms"] / kv["p50_ms"]
    if "p50_ms" in kv and copy_ms:
        entry["fraction_of_contiguous_copy"] = copy_ms / kv["p50_ms"]
    return entry


def per_token(args: argparse.Namespace, p: int, d: int, src: np.ndarray, dst: np.ndarray) -> dict:
    """The per-token head-slice descriptors of every rank pair (SGLang's pattern), raw NIXL."""
    sdev, ddev = devices(args)
    jobs = baseline_jobs(args, p, d, src, dst)

    def rank_bytes(tp: int) -> int:
        return 2 * args.layers * args.pool_pages * args.page_size * (args.heads // tp) * args.head_dim * 2

    t = run_raw(
        [(ddev, rank_bytes(d)) for _ in range(d)],
        [(sdev, rank_bytes(p), {"per_token": jobs[s]}) for s in range(p)],
        args.iters,
        net=args.net,
    )["per_token"]
    ndesc = sum(int(j.local_idx.size) for js in jobs.values() for j in js)
    base = summarize(t) | {"samples_ms": [x * 1e3 for x in t], "descriptors": ndesc}
    print(f"{p}->{d} per-token baseline: {base['p50_ms']:.1f} ms ({ndesc} descriptors)", file=sys.stderr)
    return base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base_args(ap, netns=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=64, help="scattered pages moved (x16 tokens)")
    ap.add_argument("--pool-pages", type=int, default=256)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--configs", default="2:1,1:2,4:2", help="sender:receiver TP list")
    ap.add_argument("--vram-staging-mb", type=int, default=1024)
    ap.add_argument("--same-node", action="store_true", help="one service serves every rank (the lane)")
    ap.add_argument(
        "--skip-per-token",
        action="store_true",
        help="no per-token NIXL baseline (millions of descriptors at 2 GiB)",
    )
    args = ap.parse_args()
    if args.small:
        args.layers, args.pages, args.pool_pages, args.iters, args.configs = 2, 4, 16, 2, "2:1"
    rng = np.random.default_rng(0)
    src = rng.choice(args.pool_pages, args.pages, replace=False).astype(np.int64)
    dst = rng.choice(args.pool_pages, args.pages, replace=False).astype(np.int64)
    full_bytes = args.pages * args.page_size * args.heads * args.head_dim * 2 * 2 * args.layers
    env = {"KVSERVICE_VRAM_STAGING_MB": str(args.vram_staging_mb)} if args.device != "cpu" else {}
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    results: dict = {}
    sdev, ddev = devices(args)
    t = contiguous_copy(sdev, ddev, full_bytes, max(args.iters, 5))
    copy = summarize(t) | {"samples_ms": [x * 1e3 for x in t]}
    print(f"contiguous copy: {copy['p50_ms']:.2f} ms", file=sys.stderr)
    nsvc = 1 if args.same_node else 2
    with network(args) as args.net, Services(nsvc, env | route_env(args), net=args.net) as svc:
        for p, d in configs:
            results[f"{p}->{d}"] = one_config(args, svc, p, d, src, dst, full_bytes, copy["p50_ms"])
    report = {
        "benchmark": "mixed_tp",
        "netns": args.netns,
        "same_node": args.same_node,
        "device": args.device,
        "src_gpu": args.src_gpu,
        "dst_gpu": args.dst_gpu,
        "layout": {
            "layers": args.layers,
            "kv_heads": args.heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "dtype": "bfloat16",
        },
        "pages": args.pages,
        "bytes": full_bytes,
        "iters": args.iters,
        "baselines": {"contiguous_copy": copy},
        "configs": results,
    }
    write_json(args.out, f"mixed_tp_{run_tag(args)}", report)


if __name__ == "__main__":
    main()
