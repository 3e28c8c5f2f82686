"""Scattered delta, same TP: kvservice end to end vs raw NIXL per-page descriptors vs one
contiguous descriptor (the ceiling), same layout and page indices, one run.

    .venv/bin/python bench/bench_transfer.py --device cpu [--small]
    python bench/bench_transfer.py --device cuda [--src-gpu 0 --dst-gpu 1]
    .venv/bin/python bench/bench_transfer.py --same-node ...   # both engines on one service

--same-node: one service serves both engines, so AUTO takes the fused route; "packed" forces the
staged route it replaced. Extra baselines in the same run: one contiguous copy of the bytes
(memcpy on CPU, device or peer copy on GPU) and the fused kernel alone (no service).

Full size: 32 layers x K/V, 8 KV heads x 128 x bf16, page 16 tokens (32 KiB per page per
region), 1,024 scattered pages = 2 GiB, 65,536 descriptors for the per-page baseline.
kvservice time is SendDelta → receiver DONE (gRPC over UDS, watch stream), per path.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _harness import (
    Services,
    base_args,
    devices,
    lane_stats,
    network,
    pools,
    progress,
    route_env,
    run_tag,
    summarize,
    write_json,
)
from _rawnixl import Job, page_rows, region_page_idx, run_raw
from _same_node import contiguous_copy, contiguous_copy_anon, fused_kernel_only
from kvservice_client import Client, Layout

PHASES = ("queue", "plan", "pack", "wire", "unpack", "total")


def kvservice_runs(
    args: argparse.Namespace, layout: Layout, src: np.ndarray, dst: np.ndarray, paths: list[str]
) -> dict:
    sdev, ddev = devices(args)
    env = {"KVSERVICE_VRAM_STAGING_MB": str(args.vram_staging_mb)} if args.device != "cpu" else {}
    logs = Path(tempfile.mkdtemp(prefix="kvbench-logs-")) if args.timeline else None
    if (
        logs is not None
    ):  # the services' per-batch DEBUG lines (kvservice/transfer/routes/packed.py, inbound.py)
        env |= {"KVSERVICE_LOG_LEVEL": "DEBUG", "KVSERVICE_LOG_FORMAT": "json"}
    out: dict = {}
    t0_mono: dict[str, float] = {}  # the last round's SendDelta call and receiver-DONE seen, per path
    t_done_mono: dict[str, float] = {}
    t_sent_mono: dict[str, float] = {}
    with (
        Services(1 if args.same_node else 2, env | route_env(args), net=args.net, log_dir=logs) as svc,
        pools((layout, sdev, 1), (layout, ddev, None)) as (
            ps,
            pr,
        ),
    ):
        a, b = svc.addresses[0], svc.addresses[-1]
        peer = svc.peer_addresses[-1]
        sender = svc.peer_addresses[0]  # ExpectDelta names the sending service, as the adapters do
        with Client(a, client_name="bench-tx") as ka, Client(b, client_name="bench-rx") as kb:
            ra = ka.register_buffers(layout, *ps.regions()).buffer_set_id
            rb = kb.register_buffers(layout, *pr.regions()).buffer_set_id
            for path in paths:
                samples, phases, sstat, rstat, err = [], [], None, None, ""
                for it in progress(range(args.iters + 1), f"kvservice {path}"):
                    tid = f"xfer-{path}-{it}"
                    kb.expect_delta(tid, rb, prefix_pages=0, dst_page_indices=dst, sender_address=sender)
                    if args.expect_lead_ms:  # the prefill's compute between ExpectDelta and SendDelta
                        time.sleep(args.expect_lead_ms / 1000)
                    t0, t0_mono[path] = time.perf_counter(), time.monotonic()
                    ka.send_delta(tid, ra, src_page_indices=src, peer_address=peer, path=path)
                    t_sent_mono[path] = time.monotonic()
                    try:
                        (rstat,) = kb.wait(tid, timeout=60)
                        dt = time.perf_counter() - t0
                        t_done_mono[path] = time.monotonic()
                        (sstat,) = ka.wait(tid, timeout=60)
                    except Exception as exc:  # keep the numbers of the other paths
                        err = f"{type(exc).__name__}: {exc}"
                        break
                    if rstat.state != "DONE" or sstat.state != "DONE":
                        err = f"sender {sstat.state} {sstat.error!r}; receiver {rstat.state} {rstat.error!r}"
                        break
                    if it:  # the first round warms handshakes, lists and kernels
                        samples.append(dt)
                        phases.append(
                            {k: sstat.timings_us.get(k, 0) for k in PHASES}
                            | {
                                "recv_unpack": rstat.timings_us.get("unpack", 0),
                                "recv_total": rstat.timings_us.get("total", 0),
                            }
                        )
                entry: dict = {"error": err} if err else {}
                if samples:
                    check = [0, len(src) // 2, len(src) - 1]
                    entry.update(
                        summarize(samples),
                        samples_ms=[s * 1e3 for s in samples],
                        path_taken=sstat.path if sstat else "",
                        bytes_sent=sstat.bytes_sent if sstat else 0,
                        descriptors=sstat.descriptors if sstat else 0,
                        phases_us_median={k: float(np.median([p[k] for p in phases])) for k in phases[0]},
                        verified=ps.page_digest(src[check].tolist()) == pr.page_digest(dst[check].tolist()),
                    )
                out[path] = entry
                print(
                    f"kvservice path={path}: {entry.get('p50_ms', float('nan')):.2f} ms {err}",
                    file=sys.stderr,
                )
            kb.unregister_buffers(rb)
            ka.unregister_buffers(ra)
        if args.same_node:
            t = fused_kernel_only(layout, ps, pr, src, dst, args.iters)
            out["_fused_kernel_only"] = summarize(t) | {"samples_ms": [x * 1e3 for x in t]}
            print(f"fused kernel alone: {out['_fused_kernel_only']['p50_ms']:.2f} ms", file=sys.stderr)
    if logs is not None:  # the services have exited: their logs are complete
        if stats := lane_stats(logs):
            out["_lane_stats"] = stats
        for path in paths:
            if "p50_ms" in out.get(path, {}):
                out[path]["timeline"] = timeline(logs, f"xfer-{path}-{args.iters}")
                if chunks := lane_timeline(logs, f"xfer-{path}-{args.iters}", t0_mono[path]):
                    out[path]["lane_timeline"] = chunks
                ms = lambda t, z=t0_mono[path]: round((t - z) * 1e3, 3)  # noqa: E731
                out[path]["points_ms"] = points(logs, f"xfer-{path}-{args.iters}", t0_mono[path]) + [
                    {"svc": "bench", "point": "send_delta_returned", "ms": ms(t_sent_mono[path])},
                    {"svc": "bench", "point": "receiver_done_seen", "ms": ms(t_done_mono[path])},
                ]
        shutil.rmtree(logs, ignore_errors=True)
    return out


def points(logs: Path, transfer_id: str, t0: float) -> list[dict]:
    """The services' "transfer point" lines of ``transfer_id`` (kvservice/transfer/trace.py), in
    ms since the bench called SendDelta (one monotonic clock), in time order."""
    rows = []
    for f in sorted(logs.glob("svc*.log")):
        for line in f.read_text().splitlines():
            if '"transfer point"' in line and '"transfer_id": "' + transfer_id + '"' in line:
                rec = json.loads(line)
                rows.append({"svc": f.stem, "point": rec["point"], "ms": round((rec["t"] - t0) * 1e3, 3)})
    return sorted(rows, key=lambda r: r["ms"])


def timeline(logs: Path, transfer_id: str) -> list[dict]:
    """Per packed batch of ``transfer_id``: ms since its chunk was queued at which the sender
    started it, held a staging slot, had packed, had written; the receiver's unpack start/end."""
    sent, unpacked = {}, {}
    for f in sorted(logs.glob("svc*.log")):
        for line in f.read_text().splitlines():
            if '"transfer_id": "' + transfer_id + '"' not in line:
                continue
            rec = json.loads(line)
            if rec.get("msg") == "packed batch":
                sent[rec["first"]] = rec
            elif rec.get("msg") == "unpacked batch":
                unpacked[rec["first"]] = rec["t"]
    if not sent:
        return []
    zero = min(r["t"][0] for r in sent.values())
    ms = lambda t: round((t - zero) * 1e3, 3)  # noqa: E731
    rows = []
    for first, r in sorted(sent.items(), key=lambda kv: kv[1]["t"][1]):
        _, start, slot, packed, written, _ = r["t"]
        u = unpacked.get(first)
        rows.append(
            {"first": first, "bytes": r["bytes"], "start": ms(start), "slot": ms(slot), "packed": ms(packed),
             "written": ms(written), "unpack_start": ms(u[0]) if u else None,
             "unpack_end": ms(u[1]) if u else None}
        )  # fmt: skip
    return rows


def lane_timeline(logs: Path, transfer_id: str, t0: float) -> dict:
    """The cross-node lane's chunks of ``transfer_id`` ("lane chunk" DEBUG lines, csrc/state.h
    ChunkTrace), in ms since SendDelta was called (``t0``), and per stage the median chunk's time and
    rate. ``write_seen`` runs from the post to when the sender saw the WRITE done, an upper bound
    of the WRITE (the sender looks after its next pack); ``span_ms``: from the first pack's start
    to the last unpack's end; ``idle_ms``: time in the span when no pack, WRITE (as seen) or
    unpack ran."""
    send, recv = {}, {}
    for f in sorted(logs.glob("svc*.log")):
        for line in f.read_text().splitlines():
            if '"lane chunk"' in line and '"transfer_id": "' + transfer_id + '"' in line:
                rec = json.loads(line)
                (send if rec["side"] == "send" else recv)[rec["first"]] = rec
    if not send:
        return {}
    ms = lambda t: round((t - t0) * 1e3, 3)  # noqa: E731
    rows, spans = [], []
    for first in sorted(send):
        s, r = send[first]["t"], recv.get(first, {}).get("t")
        row = {"first": first, "bytes": send[first]["bytes"], "pack_start": ms(s[0]), "packed": ms(s[1]),
               "posted": ms(s[2]), "write_seen": ms(s[3]), "noted": ms(s[4])}  # fmt: skip
        spans += [(s[0], s[1]), (s[1], s[3])]
        if r:
            row |= {
                "note_got": ms(r[0]),
                "unpack_start": ms(r[1]),
                "unpacked": ms(r[2]),
                "answered": ms(r[3]),
            }
            spans.append((r[1], r[2]))
        rows.append(row)
    stages = {}
    for name, a, b in (("pack", "pack_start", "packed"), ("post", "packed", "posted"),
                       ("write_seen", "packed", "write_seen"), ("note", "write_seen", "note_got"),
                       ("unpack", "unpack_start", "unpacked")):  # fmt: skip
        d = [
            (row[b] - row[a], row["bytes"])
            for row in rows
            if row.get(a) is not None and row.get(b) is not None
        ]
        if d:
            stages[name] = {"median_ms": round(float(np.median([x for x, _ in d])), 4)}
            if name in ("pack", "write_seen", "unpack") and all(x > 0 for x, _ in d):  # GB/s
                stages[name]["median_gbps"] = round(float(np.median([n / (x * 1e6) for x, n in d])), 1)
    spans.sort()
    idle, reach = 0.0, spans[0][0]
    for a, b in spans:
        idle += max(0.0, a - reach)
        reach = max(reach, b)
    return {
        "chunks": rows,
        "stages": stages,
        "first_pack_ms": ms(spans[0][0]),
        "span_ms": round((reach - spans[0][0]) * 1e3, 3),
        "last_unpack_ms": ms(reach),
        "idle_ms": round(idle * 1e3, 3),
    }


def main() -> None:
    args = parse()
    with network(args) as args.net:
        run(args)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base_args(ap, netns=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=1024, help="scattered pages moved")
    ap.add_argument("--pool-pages", type=int, default=2048, help="pages per region in each pool")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--paths", default="", help="comma list; default auto,direct,packed on CPU, auto on GPU")
    ap.add_argument("--vram-staging-mb", type=int, default=2048)  # the service default
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--same-node", action="store_true", help="one service for both engines (fused route)")
    ap.add_argument("--skip-nixl", action="store_true", help="no raw NIXL baselines (same-node runs)")
    ap.add_argument(
        "--expect-lead-ms",
        type=float,
        default=0.0,
        help="pause between ExpectDelta and SendDelta (the prefill's compute; the receiver's offer "
        "travels meanwhile); the timer starts at SendDelta either way",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="record each packed batch's pack / write / unpack times of the last round per path "
        "(services log at DEBUG) into the JSON",
    )
    args = ap.parse_args()
    if args.small:
        args.layers, args.pages, args.pool_pages, args.iters = 2, 32, 64, 2
    return args


def run(args: argparse.Namespace) -> None:
    paths = (
        args.paths.split(",")
        if args.paths
        else (
            ["auto", "packed"]
            if args.same_node
            else (["auto", "direct", "packed"] if args.device == "cpu" else ["auto"])
        )
    )
    layout = Layout.mha(
        num_layers=args.layers,
        page_size=args.page_size,
        num_pages=args.pool_pages,
        total_kv_heads=args.heads,
        head_dim=args.head_dim,
        dtype="bfloat16",
    )
    rng = np.random.default_rng(0)
    src = rng.choice(args.pool_pages, args.pages, replace=False).astype(np.int64)
    dst = rng.choice(args.pool_pages, args.pages, replace=False).astype(np.int64)
    R, pb = 2 * args.layers, layout.page_bytes_k
    region_bytes, total = pb * args.pool_pages, pb * args.pages * 2 * args.layers
    pool_bytes = region_bytes * R
    sdev, ddev = devices(args)

    base: dict = {}
    if not args.skip_baseline:
        t = contiguous_copy(sdev, ddev, total, args.iters)
        base["contiguous_copy"] = summarize(t) | {"samples_ms": [x * 1e3 for x in t]}
        print(f"contiguous copy: {base['contiguous_copy']['p50_ms']:.2f} ms", file=sys.stderr)
        if sdev == "cpu":
            t = contiguous_copy_anon(total, args.iters)
            base["contiguous_copy_anon"] = summarize(t) | {"samples_ms": [x * 1e3 for x in t]}
    if not args.skip_baseline and not args.skip_nixl:
        rows = page_rows(R, region_bytes, pb, args.pool_pages)
        per_page = Job(
            0, rows, rows, region_page_idx(R, args.pool_pages, src), region_page_idx(R, args.pool_pages, dst)
        )
        one = np.array([[0, total, 0, total, 1]], dtype=np.int64)
        ceiling = Job(0, one, one, np.zeros(1, np.int32), np.zeros(1, np.int32))
        cases = {"raw_nixl_per_page": [per_page], "raw_nixl_one_descriptor": [ceiling]}
        times = run_raw([(ddev, pool_bytes)], [(sdev, pool_bytes, cases)], args.iters, net=args.net)
        for name, t in times.items():
            n = int(cases[name][0].local_idx.size)
            base[name] = summarize(t) | {"samples_ms": [x * 1e3 for x in t], "descriptors": n}
            print(f"{name}: {base[name]['p50_ms']:.2f} ms", file=sys.stderr)

    kv = kvservice_runs(args, layout, src, dst, paths)
    if "_fused_kernel_only" in kv:
        base["fused_kernel_only"] = kv.pop("_fused_kernel_only")
    lane = kv.pop("_lane_stats", None)
    gbps = lambda ms: total / (ms * 1e-3) / 1e9  # noqa: E731
    for d in list(base.values()) + list(kv.values()):
        if "p50_ms" in d:
            d["gb_per_s"] = gbps(d["p50_ms"])
    ratios: dict = {}
    ok = {p: d for p, d in kv.items() if "p50_ms" in d}
    for p, d in ok.items():
        ratios[p] = {
            name: base[ref]["p50_ms"] / d["p50_ms"]
            for name, ref in (
                ("speedup_vs_per_page", "raw_nixl_per_page"),
                ("fraction_of_ceiling", "raw_nixl_one_descriptor"),
                ("fraction_of_contiguous_copy", "contiguous_copy"),
                ("fraction_of_contiguous_copy_anon", "contiguous_copy_anon"),
            )
            if ref in base
        }
    if "fused_kernel_only" in base and "contiguous_copy" in base:
        ratios["fused_kernel_only"] = {
            "fraction_of_contiguous_copy": base["contiguous_copy"]["p50_ms"]
            / base["fused_kernel_only"]["p50_ms"]
        }
    if "direct" in ok and "packed" in ok and "auto" in ok:
        best = min(ok["direct"]["p50_ms"], ok["packed"]["p50_ms"])
        ratios["auto_vs_best_of_direct_packed"] = ok["auto"]["p50_ms"] / best
    report = {
        "benchmark": "transfer",
        "same_node": args.same_node,
        "netns": args.netns,
        "device": args.device,
        "src_gpu": args.src_gpu,
        "dst_gpu": args.dst_gpu,
        "layout": {
            "layers": args.layers,
            "kv_heads": args.heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "dtype": "bfloat16",
            "page_bytes_per_region": pb,
        },
        "pages": args.pages,
        "pool_pages": args.pool_pages,
        "bytes": total,
        "iters": args.iters,
        "baselines": base,
        "kvservice": kv,
        "ratios": ratios,
    }
    if lane:
        report["lane_stats"] = lane
    write_json(args.out, f"transfer{'_same_node' if args.same_node else ''}_{run_tag(args)}", report)
    for k, v in ratios.items():
        print(f"  {k}: {v}", file=sys.stderr)


if __name__ == "__main__":
    main()
