"""Multi-turn workload (seed 000, scaled): sessions share long prefixes (~50K tokens) and add
short suffixes (~4.5K tokens, ~91% reuse). Delta (prefix_pages from the receiver's MatchPrefix)
vs full prefix (prefix_pages=0), same requests, one run: bytes on the wire, transfer time,
success rate, p50/p99.

    .venv/bin/python bench/bench_multiturn.py --device cpu [--small]
    python bench/bench_multiturn.py --device cuda [--src-gpu 0 --dst-gpu 1]

Per request (latency clock from MatchPrefix to receiver DONE): the decode side matches the
prompt in its kvservice index, allocates pages for the rest from its free list, ExpectDelta; the
prefill side SendDelta of all the prompt's pages (the service skips the receiver's prefix). After
DONE the decode side publishes the session prefix (first time) and frees the suffix pages. The
first request of each session runs alone (cold); the rest run ``--concurrency`` at a time.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _harness import KVPool, Services, base_args, devices, progress, route_env, run_tag, summarize, write_json
from kvservice_client import Client, Layout


class FreeList:
    def __init__(self, pages: range) -> None:
        self.free, self.lock = list(pages), threading.Lock()

    def take(self, n: int) -> list[int]:
        with self.lock:
            if n > len(self.free):
                raise RuntimeError(f"pool exhausted: need {n}, {len(self.free)} free")
            out, self.free = self.free[:n], self.free[n:]
            return out

    def give(self, pages: list[int]) -> None:
        with self.lock:
            self.free.extend(pages)


def run_mode(
    args: argparse.Namespace, mode: str, requests: list[tuple[int, np.ndarray]], prefixes: list[np.ndarray]
) -> dict:
    sdev, ddev = devices(args)
    ps, pp = args.page_size, args.prefix_tokens // args.page_size + 1
    sp = (args.suffix_tokens * 3 // 2) // ps + 2
    n_tx = args.sessions * pp + args.concurrency * sp + 8
    n_rx = (args.sessions * pp if mode == "delta" else 0) + args.concurrency * (pp + sp) + 8

    def mk(n):
        return Layout.mha(
            num_layers=args.layers,
            page_size=ps,
            num_pages=n,
            total_kv_heads=args.heads,
            head_dim=args.head_dim,
            dtype="bfloat16",
        )  # noqa: E731

    env = {"KVSERVICE_VRAM_STAGING_MB": str(args.vram_staging_mb)} if args.device != "cpu" else {}
    page_all = mk(1).page_bytes_all_layers
    rows: list[dict] = []
    with Services(2, env | route_env(args)) as svc:
        a, b = svc.addresses
        tx, rx = KVPool(mk(n_tx), sdev, None), KVPool(mk(n_rx), ddev, None)
        try:
            with Client(a, client_name="prefill") as ka, Client(b, client_name="decode") as kb:
                sa = ka.register_buffers(tx.layout, *tx.regions()).buffer_set_id
                sb = kb.register_buffers(rx.layout, *rx.regions()).buffer_set_id
                tx_free = FreeList(range(args.sessions * pp, n_tx))
                rx_free = FreeList(range(n_rx))
                published: dict[int, list[int]] = {}

                def one(i: int, sess: int, suffix: np.ndarray) -> dict:
                    tokens = np.concatenate([prefixes[sess], suffix])
                    npages = -(-tokens.size // ps)
                    pfx_full = prefixes[sess].size // ps
                    tid = f"{mode}-{i}"
                    row: dict = {"request": i, "session": sess, "tokens": int(tokens.size), "pages": npages}
                    t0 = time.perf_counter()
                    if mode == "delta":
                        m = kb.match_prefix(tokens=tokens, page_size=ps, buffer_set_ids=[sb])
                        best = m.best
                        held = list(best.page_indices) if best else []
                    else:
                        held = []
                    row["match_ms"] = (time.perf_counter() - t0) * 1e3
                    new = rx_free.take(npages - len(held))
                    tx_sfx = tx_free.take(npages - pfx_full)
                    src = list(range(sess * pp, sess * pp + pfx_full)) + tx_sfx
                    try:
                        kb.expect_delta(
                            tid, sb, prefix_pages=len(held), dst_page_indices=new, prefix_page_indices=held
                        )
                        ka.send_delta(tid, sa, src_page_indices=src, peer_address=b)
                        (r,) = kb.wait(tid, timeout=args.timeout_s)
                        row["latency_ms"] = (time.perf_counter() - t0) * 1e3
                        (s,) = ka.wait(tid, timeout=args.timeout_s)
                        row.update(
                            ok=r.state == "DONE" and s.state == "DONE",
                            error=r.error or s.error,
                            prefix_pages=len(held),
                            bytes_sent=s.bytes_sent,
                            bytes_needed=(npages - len(held)) * page_all,
                            pages_sent=s.pages_sent,
                            pages_skipped=s.pages_skipped,
                            path=s.path,
                            wire_us=s.timings_us.get("wire", 0),
                            total_us=s.timings_us.get("total", 0),
                        )
                    except Exception as exc:  # a failed request counts; the run goes on
                        row.update(
                            ok=False,
                            error=f"{type(exc).__name__}: {exc}",
                            latency_ms=(time.perf_counter() - t0) * 1e3,
                        )
                    finally:
                        tx_free.give(tx_sfx)
                    keep: list[int] = []
                    if mode == "delta" and row.get("ok") and sess not in published and len(held) < pfx_full:
                        pages = held + new[: pfx_full - len(held)]
                        kb.publish_pages(sb, pages, tokens=tokens[: pfx_full * ps])
                        published[sess] = pages
                        keep = new[: pfx_full - len(held)]
                    rx_free.give([p for p in new if p not in set(keep)])
                    return row

                cold = [(i, s, x) for i, (s, x) in enumerate(requests) if i < args.sessions]
                warm = [(i, s, x) for i, (s, x) in enumerate(requests) if i >= args.sessions]
                for i, s, x in progress(cold, f"{mode} cold"):
                    rows.append(one(i, s, x) | {"cold": True})
                t_warm = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    futs = [pool.submit(one, i, s, x) for i, s, x in warm]
                    for f in progress(futs, f"{mode} warm", total=len(futs)):
                        rows.append(f.result() | {"cold": False})
                warm_s = time.perf_counter() - t_warm
                kb.unregister_buffers(sb)
                ka.unregister_buffers(sa)
        finally:
            tx.close()
            rx.close()
    ok = [r for r in rows if r.get("ok")]
    sent, needed = sum(r["bytes_sent"] for r in ok), sum(r["bytes_needed"] for r in ok)
    out = {
        "requests": len(rows),
        "ok": len(ok),
        "success_rate": len(ok) / max(len(rows), 1),
        "errors": sorted({r["error"] for r in rows if not r.get("ok")})[:5],
        "latency": summarize([r["latency_ms"] / 1e3 for r in ok]),
        "latency_warm": summarize([r["latency_ms"] / 1e3 for r in ok if not r["cold"]]),
        "match": summarize([r["match_ms"] / 1e3 for r in ok]),
        "warm_requests_per_s": len(warm) / warm_s if warm else 0.0,
        "bytes_sent_total": sent,
        "bytes_needed_total": needed,
        "wire_bytes_over_needed": sent / needed if needed else float("nan"),
        "bytes_sent_mean": sent / max(len(ok), 1),
        "reuse": 1 - sum(r["pages"] - r["prefix_pages"] for r in ok) / max(sum(r["pages"] for r in ok), 1),
        "paths": sorted({r.get("path", "") for r in ok}),
        "rows": rows,
    }
    lat = out["latency"]
    print(
        f"{mode}: ok {len(ok)}/{len(rows)} p50 {lat.get('p50_ms', 0):.1f} ms"
        f" p99 {lat.get('p99_ms', 0):.1f} ms, {sent / 2**30:.2f} GiB sent",
        file=sys.stderr,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base_args(ap)
    ap.add_argument("--layers", type=int, default=8, help="scaled down from 32 to fit pools in memory")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sessions", type=int, default=4, help="unique prefixes (seed: 20)")
    ap.add_argument("--requests", type=int, default=40, help="requests in all (seed: 1,000)")
    ap.add_argument("--prefix-tokens", type=int, default=50_000)
    ap.add_argument("--suffix-tokens", type=int, default=4_500)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight (seed: 128)")
    ap.add_argument("--modes", default="delta,full")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--vram-staging-mb", type=int, default=1024)
    args = ap.parse_args()
    if args.small:
        (
            args.layers,
            args.sessions,
            args.requests,
            args.prefix_tokens,
            args.suffix_tokens,
            args.concurrency,
        ) = 2, 2, 6, 800, 80, 2
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 150_000, args.prefix_tokens, dtype=np.int64) for _ in range(args.sessions)]
    requests = []
    for i in range(args.requests):
        n = int(args.suffix_tokens * rng.uniform(0.8, 1.2))
        requests.append((i % args.sessions, rng.integers(0, 150_000, n, dtype=np.int64)))
    modes = {m: run_mode(args, m, requests, prefixes) for m in args.modes.split(",")}
    ratios = {}
    if "delta" in modes and "full" in modes:
        d, f = modes["delta"], modes["full"]
        ratios = {
            "bytes_full_over_delta": f["bytes_sent_total"] / max(d["bytes_sent_total"], 1),
            "p50_full_over_delta": f["latency"].get("p50_ms", 0)
            / max(d["latency"].get("p50_ms", 1e-9), 1e-9),
            "p99_full_over_delta": f["latency"].get("p99_ms", 0)
            / max(d["latency"].get("p99_ms", 1e-9), 1e-9),
        }
    report = {
        "benchmark": "multiturn",
        "device": args.device,
        "src_gpu": args.src_gpu,
        "dst_gpu": args.dst_gpu,
        "workload": {
            k: getattr(args, k)
            for k in (
                "layers",
                "heads",
                "head_dim",
                "page_size",
                "sessions",
                "requests",
                "prefix_tokens",
                "suffix_tokens",
                "concurrency",
            )
        },
        "modes": modes,
        "ratios": ratios,
    }
    write_json(args.out, f"multiturn_{run_tag(args)}", report)


if __name__ == "__main__":
    main()
