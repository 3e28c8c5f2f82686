"""Control plane: p50/p99 of MatchPrefix (131,072-token prompt over the UDS), ExpectDelta,
SendDelta and Poll; one-page transfer end to end vs a raw NIXL one-descriptor write of the same
page (the per-transfer overhead) and vs a plain unary RPC (a health check on the receiving
engine's channel, same run); sustained tiny transfers per second.

    .venv/bin/python bench/bench_control.py [--small] [--same-node]

--same-node: both engines on one service (the fused route); transfer_e2e is then SendDelta call →
DONE seen by the receiving engine (its WatchTransfers stream), with ExpectDelta done before.

Pools are shared memory, or with ``--device cuda`` one CUDA allocation per engine (the sender's
on ``--src-gpu``, the receiver's on ``--dst-gpu``); the index's pool stays in shared memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
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
from kvservice_client import Client, Layout


def timed(samples: list[float], fn, *a, **kw):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    r = fn(*a, **kw)
    samples.append(time.perf_counter() - t0)
    return r


def expect_ab(kb: Client, rb: str, sender: str, n: int, lat: dict[str, list[float]]) -> None:
    """ExpectDelta on the engine's lane (a CALL) against the same call on the session's Transfers
    stream, interleaved (each declaration aborted): ``expect_delta_lane_ab`` /
    ``expect_delta_stream_ab``. The lane's is what ``expect_delta`` measures when the service
    answers CALLs; the stream's is the baseline."""
    lane = kb._lane.lane
    if lane is None or "expect_delta" not in lane.calls_served:
        return
    served = lane.calls_served
    for i in range(n):
        for key, calls in (("expect_delta_lane_ab", served), ("expect_delta_stream_ab", frozenset())):
            lane.calls_served = calls  # NOTE: the SDK's own switch: no CALL, the stream instead
            tid = f"ab-{key[13:17]}-{i}"
            kw = {"prefix_pages": 0, "dst_page_indices": [i % 64], "sender_address": sender}
            timed(lat[key], kb.expect_delta, tid, rb, **kw)
            kb.abort(tid)
    lane.calls_served = served


def _engine_pair(
    a: str,
    b: str,
    peer: str,
    sender: str,
    lay: Layout,
    devs: tuple,
    threads: int,
    sustain_s: float,
    sync: tuple,
    tag: str,
) -> None:
    """One sending and one receiving engine process pair's worth of senders (``--sustain-procs``):
    own pools, clients, sessions and lanes. Says ready after one warm transfer, then runs
    ``threads`` senders (expect → send → wait) from the start signal for ``sustain_s``; puts
    (done, errors) on the out queue."""
    ready, start, out = sync
    sp, rp = KVPool(lay, devs[0], 1), KVPool(lay, devs[1])
    try:
        with Client(a, client_name="sus-tx") as ka, Client(b, client_name="sus-rx") as kb:
            sb = ka.register_buffers(lay, *sp.regions()).buffer_set_id
            rb = kb.register_buffers(lay, *rp.regions()).buffer_set_id
            kb.expect_delta(f"{tag}-warm", rb, prefix_pages=0, dst_page_indices=[0], sender_address=sender)
            ka.send_delta(f"{tag}-warm", sb, src_page_indices=[0], peer_address=peer)
            kb.wait(f"{tag}-warm", timeout=60)
            ready.put(tag)
            start.wait()
            done: list[int] = [0]
            errors: list[str] = []
            stop = time.monotonic() + sustain_s
            ends = (ka, kb, sb, rb, peer, sender)
            ths = [
                threading.Thread(target=_sustain_worker, args=(ends, w, f"{tag}-{w}", stop, done, errors))
                for w in range(threads)
            ]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            out.put((done[0], errors[:5]))
    finally:
        sp.close()
        rp.close()


def _sustain_worker(ends: tuple, w: int, tag: str, stop: float, done: list[int], errors: list[str]) -> None:
    ka, kb, sb, rb, peer, sender = ends
    n = 0
    while time.monotonic() < stop:
        tid = f"{tag}-{n}"
        try:
            kb.expect_delta(tid, rb, prefix_pages=0, dst_page_indices=[w % 64], sender_address=sender)
            ka.send_delta(tid, sb, src_page_indices=[w % 64], peer_address=peer)
            (st,) = kb.wait(tid, timeout=30)
            done[0] += st.state == "DONE"
        except Exception as exc:
            errors.append(str(exc))
        n += 1


def sustain_procs(
    svc: Services, args: argparse.Namespace, xl: Layout, devs: tuple[str | int, str | int], senders: int
) -> dict:
    """``senders`` one-page senders spread over ``--sustain-procs`` engine process pairs (engines
    are separate processes in a deployment: one bench process's GIL is not the service's limit)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    n_procs = max(1, min(args.sustain_procs, senders))
    per = [senders // n_procs + (i < senders % n_procs) for i in range(n_procs)]
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    a, b, peer = svc.addresses[0], svc.addresses[-1], svc.peer_addresses[-1]
    sender = "" if args.same_node else svc.peer_addresses[0]  # ExpectDelta names it, as adapters do
    ps = [
        ctx.Process(
            target=_engine_pair,
            args=(a, b, peer, sender, xl, devs, n, args.sustain_s, (ready, start, out), f"p{senders}-{i}"),
        )
        for i, n in enumerate(per)
    ]
    for p in ps:
        p.start()
    for _ in ps:  # every pair imported, registered and moved one page before the clock starts
        ready.get(timeout=180)
    t0 = time.perf_counter()
    start.set()
    got = [out.get(timeout=args.sustain_s + 60) for _ in ps]
    dt = time.perf_counter() - t0
    for p in ps:
        p.join(30)
    rate = sum(g[0] for g in got) / dt
    print(f"sustained, {senders} senders in {n_procs} engine pairs: {rate:.0f} transfers/s", file=sys.stderr)
    errors = [e for g in got for e in g[1]][:5]
    return {"senders": senders, "engine_pairs": n_procs, "transfers_per_s": rate, "errors": errors}


def unary_rpc(kv: Client, n: int, out: list[float]) -> None:
    """The baseline of the one-page e2e goal: a plain unary RPC (grpc.health.v1 Check, nothing
    behind it) on ``kv``'s own channel, ``n`` times after 3 warm ones."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(kv._channel)
    req = health_pb2.HealthCheckRequest()
    for i in range(n + 3):
        t0 = time.perf_counter()
        stub.Check(req, timeout=5)
        if i >= 3:
            out.append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base_args(ap, netns=True)
    ap.add_argument("--prompt-tokens", type=int, default=131_072)
    ap.add_argument("--match-iters", type=int, default=200)
    ap.add_argument("--transfers", type=int, default=300, help="sequential one-page transfers")
    ap.add_argument("--sustain-s", type=float, default=5.0)
    ap.add_argument(
        "--sustain-threads",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 8, 64],
        help="concurrent senders, comma list (one-page rows of the receiver's 64-page pool)",
    )
    ap.add_argument("--same-node", action="store_true", help="one service for both engines")
    ap.add_argument(
        "--sustain-procs",
        type=int,
        default=8,
        help="engine process pairs the multi-process sustained run spreads its senders over (0: skip it)",
    )
    args = ap.parse_args()
    if args.small:
        args.prompt_tokens, args.match_iters, args.transfers, args.sustain_s, args.sustain_threads = (
            8192,
            10,
            10,
            1.0,
            [1, 2],
        )
        args.sustain_procs = min(args.sustain_procs, 2)
    ps = 16
    # index layout: tiny pages (the index only needs page numbers); transfer layout: 1 layer, 32 KiB pages
    idx_layout = Layout.mha(
        num_layers=1,
        page_size=ps,
        num_pages=args.prompt_tokens // ps + 16,
        total_kv_heads=1,
        head_dim=8,
        dtype="bfloat16",
    )
    xl = Layout.mha(
        num_layers=1, page_size=ps, num_pages=64, total_kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    pb = xl.page_bytes_k
    page_job = Job(
        0,
        np.array([[0, pb, 0, pb, 1]]),
        np.array([[0, pb, 0, pb, 1]]),
        np.zeros(1, np.int32),
        np.zeros(1, np.int32),
    )
    with network(args) as args.net:
        run(args, idx_layout, xl, page_job)


def run(args: argparse.Namespace, idx_layout: Layout, xl: Layout, page_job: Job) -> None:
    ps, pb = idx_layout.page_size, xl.page_bytes_k
    sdev, ddev = devices(args)
    raw = run_raw(
        [(ddev, pb * 4)], [(sdev, pb * 4, {"one_page": [page_job]})], max(args.transfers, 5), net=args.net
    )["one_page"]
    print(f"raw NIXL one page: p50 {np.median(raw) * 1e3:.3f} ms", file=sys.stderr)
    prompt = np.random.default_rng(0).integers(0, 150_000, args.prompt_tokens, dtype=np.int64)
    lat: dict[str, list[float]] = {
        k: []
        for k in (
            "match_prefix",
            "expect_delta",
            "send_delta",
            "poll",
            "transfer_e2e",
            "unary_rpc",
            "expect_delta_lane_ab",
            "expect_delta_stream_ab",
        )
    }
    with Services(1 if args.same_node else 2, route_env(args), net=args.net) as svc:
        a, b = svc.addresses[0], svc.addresses[-1]
        peer = svc.peer_addresses[-1]
        sender = "" if args.same_node else svc.peer_addresses[0]  # ExpectDelta names it, as adapters do
        ip, sp, rp = KVPool(idx_layout), KVPool(xl, sdev, 1), KVPool(xl, ddev)
        try:
            with Client(a, client_name="ctl-tx") as ka, Client(b, client_name="ctl-rx") as kb:
                ib = kb.register_buffers(idx_layout, *ip.regions()).buffer_set_id
                sb = ka.register_buffers(xl, *sp.regions()).buffer_set_id
                rb = kb.register_buffers(xl, *rp.regions()).buffer_set_id
                kb.publish_pages(ib, np.arange(args.prompt_tokens // ps), tokens=prompt)
                for _ in range(3):  # warm (JIT, caches)
                    kb.match_prefix(tokens=prompt, page_size=ps)
                for _ in progress(range(args.match_iters), "MatchPrefix"):
                    m = timed(
                        lat["match_prefix"], kb.match_prefix, tokens=prompt, page_size=ps, buffer_set_ids=[ib]
                    )
                matched = m.best.matched_pages if m.best else 0
                unary_rpc(kb, args.transfers, lat["unary_rpc"])
                for i in progress(range(args.transfers + 3), "tiny transfers"):
                    tid = f"ctl-{i}"
                    t0 = time.perf_counter()
                    timed(
                        lat["expect_delta"],
                        kb.expect_delta,
                        tid,
                        rb,
                        prefix_pages=0,
                        dst_page_indices=[i % 64],
                        sender_address=sender,
                    )
                    if args.same_node:  # SendDelta call -> DONE on the receiver's watch stream
                        t0 = time.perf_counter()
                        timed(
                            lat["send_delta"],
                            ka.send_delta,
                            tid,
                            sb,
                            src_page_indices=[i % 64],
                            peer_address=peer,
                        )
                        (st,) = kb.wait(tid, timeout=30)
                        lat["transfer_e2e"].append(time.perf_counter() - t0)
                        lat["poll"].append(0.0)
                        if st.state != "DONE":
                            raise RuntimeError(f"tiny transfer {tid}: {st.state} {st.error}")
                        if i < 3:
                            for v in lat.values():
                                if v and v is not lat["match_prefix"]:
                                    v.pop()
                        continue
                    timed(
                        lat["send_delta"],
                        ka.send_delta,
                        tid,
                        sb,
                        src_page_indices=[(i * 7) % 64],
                        peer_address=peer,
                    )
                    while True:
                        (st,) = timed(lat["poll"], kb.poll, [tid])
                        if st.terminal:
                            break
                    lat["transfer_e2e"].append(time.perf_counter() - t0)
                    if st.state != "DONE":
                        raise RuntimeError(f"tiny transfer {tid}: {st.state} {st.error}")
                    if i < 3:  # warm-up rounds off the record
                        for v in lat.values():
                            if v and v is not lat["match_prefix"]:
                                v.pop()

                expect_ab(kb, rb, sender, args.transfers, lat)

                # sustained: threads each run expect → send → wait back to back
                def sustain(threads: int) -> dict:
                    done, stop, errors = [0], time.monotonic() + args.sustain_s, []
                    lock = threading.Lock()

                    def worker(w: int) -> None:
                        n = 0
                        while time.monotonic() < stop:
                            tid = f"sus{threads}-{w}-{n}"
                            try:
                                kb.expect_delta(
                                    tid, rb, prefix_pages=0, dst_page_indices=[w], sender_address=sender
                                )
                                ka.send_delta(tid, sb, src_page_indices=[w], peer_address=peer)
                                (st,) = kb.wait(tid, timeout=30)
                                ok = st.state == "DONE"
                            except Exception as exc:
                                ok = False
                                errors.append(str(exc))
                            with lock:
                                done[0] += ok
                            n += 1

                    t0 = time.perf_counter()
                    ths = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
                    for t in ths:
                        t.start()
                    for t in ths:
                        t.join()
                    rate = done[0] / (time.perf_counter() - t0)
                    print(f"sustained, {threads} senders: {rate:.0f} transfers/s", file=sys.stderr)
                    return {"threads": threads, "transfers_per_s": rate, "errors": errors[:5]}

                sustained = [sustain(n) for n in args.sustain_threads]
                lane = kb._lane.lane
                if lane is not None and "expect_delta" in lane.calls_served and 8 in args.sustain_threads:
                    served, lane.calls_served = lane.calls_served, frozenset()  # the baseline: on the stream
                    base = sustain(8)
                    lane.calls_served = served
                    sustained.append({**base, "expect_on": "stream"})
                by_engines = (
                    [sustain_procs(svc, args, xl, (sdev, ddev), n) for n in args.sustain_threads if n > 1]
                    if args.sustain_procs
                    else []
                )
                idle = svc.idle_cpu(0.5 if args.small else 3.0)
        finally:
            for p in (ip, sp, rp):
                p.close()
    stats = {k: summarize(v) for k, v in lat.items()}
    raw_s = summarize(raw)
    overhead = stats["transfer_e2e"]["p50_ms"] - raw_s["p50_ms"]
    e2e_vs_unary = stats["transfer_e2e"]["p50_ms"] / stats["unary_rpc"]["p50_ms"]
    report = {
        "benchmark": "control",
        "prompt_tokens": args.prompt_tokens,
        "matched_pages": matched,
        "rpc": stats,
        "raw_nixl_one_page": raw_s,
        "overhead_per_transfer_p50_ms": overhead,
        "e2e_over_unary_rpc_p50": e2e_vs_unary,  # goal on CPU: <= 2
        "sustained_s": args.sustain_s,
        "sustained_by_senders": sustained,  # threads of this one process (its GIL included)
        "sustained_by_engine_pairs": by_engines,  # senders spread over --sustain-procs processes
        # what each service process used of one core afterwards, registered and idle (the NIXL
        # progress thread's polling dominates it: --nixl-progress-delay-us)
        "idle_cpu_fraction_of_core": idle,
        "nixl_progress_delay_us": os.environ.get("KVSERVICE_NIXL_PROGRESS_DELAY_US", "default"),
        "goals": {
            "match_prefix_p50_le_5ms": stats["match_prefix"]["p50_ms"] <= 5.0,
            "overhead_p50_le_1ms": overhead <= 1.0,
        },
    }
    for k, v in stats.items():
        print(f"{k:14s} p50 {v['p50_ms']:.3f} ms p99 {v['p99_ms']:.3f} ms", file=sys.stderr)
    print(f"overhead p50 {overhead:.3f} ms; e2e / unary RPC p50 {e2e_vs_unary:.2f}", file=sys.stderr)
    print(f"idle CPU per service: {', '.join(f'{c:.1%}' for c in idle)} of a core", file=sys.stderr)
    report["device"] = args.device
    report["same_node"] = args.same_node
    report["netns"] = args.netns
    write_json(args.out, f"control{'_same_node' if args.same_node else ''}_{run_tag(args)}", report)


if __name__ == "__main__":
    main()
