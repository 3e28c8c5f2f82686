"""Claim cost: a landed transfer copied into the engine's pages, against the bare fused copy.

    .venv/bin/python bench/bench_landing.py --device cpu [--mib 16] [--iters 20]
    python bench/bench_landing.py --device cuda [--gpu 0] [--mib 64]

One kvservice; two engine pools in this process (a prefill's and a decode's) registered with it.
Each iteration: ``expect_landing`` (no destination pages) -> ``send_delta`` from the prefill pool
(the same-service fused route, into the landing pool) -> LANDED -> ``claim`` into scattered
destination pages. Reported, per iteration: the service's claim time once landed
(``ClaimResponse.claim_us``: checks, the copy, DONE, freeing), the SDK's claim round trip, and
the time from the send until LANDED. The same-run baseline is ``copy_pages`` of the same number
of pages between two pools of this process, with no service: the copy the claim is made of.
Every claim is checked (page digests). Goal (on the GPU): for 64 MiB, claim_us is at
most the copy + 0.3 ms.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _harness import Services, pools, progress, summarize, write_json
from _same_node import fused_kernel_only
from kvservice_client import Client, Layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--mib", type=int, default=None, help="bytes claimed per iteration (cpu 16, cuda 64)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="CI size: 4 MiB, 3 iterations")
    ap.add_argument("--out", default="/tmp/kvservice-bench")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.small:
        args.mib, args.iters = args.mib or 4, 3
    mib = args.mib or (16 if args.device == "cpu" else 64)
    # 32 layers x K/V x 16 tokens x 2 heads x 128 x bf16 = 512 KiB a page (all layers)
    pages = mib * 2
    layout = Layout.mha(num_layers=32, page_size=16, num_pages=2 * pages + 8, total_kv_heads=2,
                        head_dim=128, dtype="bfloat16")  # fmt: skip
    dev = "cpu" if args.device == "cpu" else args.gpu
    rng = np.random.default_rng(0)
    src = rng.permutation(layout.num_pages)[:pages]  # the prefill's pages (scattered)
    dst = rng.permutation(layout.num_pages)[:pages]  # the decode's newly allocated pages
    env = {"KVSERVICE_LANDING_POOL_MB": str(2 * mib + 8)}
    claim_us, claim_rt, landed_s = [], [], []
    with Services(1, env) as svc, pools((layout, dev, 1), (layout, dev, None)) as (pp, pd):
        with Client(svc.addresses[0], client_name="bench-landing") as kv:
            a = kv.register_buffers(layout, *pp.regions()).buffer_set_id
            b = kv.register_buffers(layout, *pd.regions()).buffer_set_id
            for it in progress(range(args.iters + 1), "claims"):
                tid = f"land-{it}"
                kv.expect_landing(tid, b, pages=pages, ttl_ms=60_000)
                t0 = time.perf_counter()
                kv.send_delta(tid, a, src_page_indices=src, peer_address=svc.peer_addresses[0])
                (st,) = kv.wait_landed(tid, timeout=60)
                t1 = time.perf_counter()
                assert st.state == "LANDED", st
                c = kv.claim(tid, b, dst_page_indices=dst)
                t2 = time.perf_counter()
                assert c.status.state == "DONE", c
                check = [0, pages // 2, pages - 1]
                assert pp.page_digest(src[check].tolist()) == pd.page_digest(dst[check].tolist()), (
                    "claim bytes"
                )
                if it:  # the first round warms kernels and the landing arena
                    claim_us.append(c.claim_us / 1e6)
                    claim_rt.append(t2 - t1)
                    landed_s.append(t1 - t0)
            pool = kv.get_stats().landing
        copy = fused_kernel_only(layout, pp, pd, np.arange(pages), dst, args.iters)  # the same copy, bare
    report = {
        "benchmark": "landing",
        "device": args.device if args.device == "cpu" else f"cuda:{args.gpu}",
        "bytes_claimed": pages * layout.page_bytes_all_layers,
        "pages": pages,
        "claim_service": summarize(claim_us),
        "claim_sdk_round_trip": summarize(claim_rt),
        "send_to_landed": summarize(landed_s),
        "copy_pages_bare": summarize(copy),
        "claim_overhead_p50_ms": float(np.median(claim_us) - np.median(copy)) * 1e3,
        "landing_pool": [ls.location for ls in pool],
        "goal": "cuda, 64 MiB: claim_service p50 <= copy_pages_bare p50 + 0.3 ms",
    }
    print(
        f"{report['device']}: claim (service) p50 {report['claim_service']['p50_ms']:.3f} ms, "
        f"bare copy p50 {report['copy_pages_bare']['p50_ms']:.3f} ms, overhead "
        f"{report['claim_overhead_p50_ms']:.3f} ms; SDK round trip p50 "
        f"{report['claim_sdk_round_trip']['p50_ms']:.3f} ms",
        file=sys.stderr,
    )
    name = f"landing_{args.device}" + (f"_{args.tag}" if args.tag else "")
    print(write_json(args.out, name, report))


if __name__ == "__main__":
    main()
