"""Transfer shapes engines really make, one 64 KiB page a chunk: SendDelta of the last chunk →
DONE seen by the receiving engine (``Client.wait``), p50/p99, each shape beside the one-chunk
shape of the same run (the reference: the lane's one-shot SEND).

    .venv/bin/python bench/bench_shapes.py [--device cuda] [--cross] [--out bench/results/...]

Shapes (``--shapes``, comma list): ``c<N>`` a transfer of N pages in N chunks; ``+aux`` an aux
row in host memory on the last chunk (SGLang's metadata rows); ``s<N>`` N chunks with the
sender "computing" ``--compute-us`` between them (layer-wise streaming: the figure is still the
last chunk's SendDelta → DONE); ``@p<M>`` a receiver of page size M (the sender's is 16, vLLM's
block: ``@p1`` and ``@p64`` are SGLang's page sizes; the receiver declares the pages the tokens
fill, its last one partly); ``@<layout>`` a receiver of another page layout (the sender's is
``nhd``, SGLang's and vLLM FlashAttention < 0.32's: ``@nhc`` is vLLM >= 0.32's default, ``@hnd``,
``@kv_nhd`` FlashInfer's). Same node by default (one service); ``--cross`` runs two services
(the cross-node routes). Each row says which route carried it (the END's ``route_note``).

``--profile DIR``: the services log at DEBUG into DIR, and each cross-node shape's row gets the
median time of each step of its chunks (the lane's chunk timeline: pack, post, WRITE, note,
unpack, answer) and each service's step totals; DEBUG logging slows the services, so a profiled
run's latencies are not the shapes' figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
from _harness import PEER_AUTHS, KVPool, Services, lane_stats, progress, summarize, write_json
from kvservice_client import AuxSpec, Client, Layout, shm_region

AUX_ROW = 64  # bytes of one aux row (SGLang's metadata row is of this order)
AUX_ROWS = 256


PAGE = 16  # the sender's page size (tokens)
PAGE_LAYOUT = "nhd"  # the sender's page layout (a shape's @<layout> another for the receiver)
PAGE_LAYOUTS = ("nhd", "hnd", "nhc", "hnc", "kv_nhd", "kv_hnd", "hnd_kv")


def _layout(pages: int, page_size: int = PAGE, page_layout: str = PAGE_LAYOUT) -> Layout:
    # 2 layers x K,V x 16 tokens x 8 heads x 64 dims x fp16 = 64 KiB a page over all its regions
    return Layout.mha(
        num_layers=2,
        page_size=page_size,
        num_pages=pages,
        total_kv_heads=8,
        head_dim=64,
        dtype="float16",
        page_layout=page_layout,  # type: ignore[arg-type]
    )


def _parse(shape: str) -> tuple[int, bool, bool, int, str]:
    """(chunks, aux, streamed, the receiver's page size and page layout) of a shape name."""
    base, *mods = shape.split("@")
    page, page_layout = PAGE, PAGE_LAYOUT
    for m in mods:
        if m in PAGE_LAYOUTS:
            page_layout = m
        elif m[:1] == "p" and m[1:].isdigit() and int(m[1:]) >= 1:
            page = int(m[1:])
        else:
            raise SystemExit(f"--shapes: {shape!r}: @{m} is neither @p<M> (M >= 1) nor a page layout")
    aux = base.endswith("+aux")
    base = base.removesuffix("+aux")
    if base[:1] not in ("c", "s") or not base[1:].isdigit() or int(base[1:]) < 1:
        raise SystemExit(f"--shapes: {shape!r} is not c<N>[+aux][@p<M>][@<layout>] or s<N>[...]")
    return int(base[1:]), aux, base[0] == "s", page, page_layout


def run_shape(
    ka: Client,
    kb: Client,
    sb: str,
    rb: str,  # the receiver's buffer set of the shape's page size
    peer: str,
    sender: str,
    shape: str,
    iters: int,
    pool_pages: int,
    compute_s: float,
) -> dict[str, Any]:
    chunks, aux, streamed, page, page_layout = _parse(shape)
    n_dst = -(-chunks * PAGE // page)  # receiver pages the chunks' tokens fill
    dst_pool = pool_pages * PAGE // page
    last_s: list[float] = []
    first_s: list[float] = []
    routes: set[str] = set()
    rng = np.random.default_rng(1)
    for i in progress(range(iters + 3), shape):
        tid = f"{shape}-{i}"
        src = rng.choice(pool_pages, chunks, replace=False)
        dst = rng.choice(dst_pool, n_dst, replace=False)
        kb.expect_delta(
            tid,
            rb,
            prefix_pages=0,
            dst_page_indices=dst,
            aux={"meta": [i % AUX_ROWS]} if aux else None,
            sender_address=sender,
        )
        t_first = time.perf_counter()
        for c in range(chunks):
            last = c == chunks - 1
            if last:
                t0 = time.perf_counter()
            ka.send_delta(
                tid,
                sb,
                src_page_indices=src[c : c + 1],
                chunk_offset=c,
                last_chunk=last,
                aux={"meta": [(i + 1) % AUX_ROWS]} if aux and last else None,
                peer_address=peer,
            )
            if streamed and not last:
                end = time.perf_counter() + compute_s  # the prefill computes the next layer
                while time.perf_counter() < end:
                    pass
        (st,) = kb.wait(tid, timeout=30)
        t1 = time.perf_counter()
        if st.state != "DONE":
            raise RuntimeError(f"{shape} {tid}: {st.state} {st.error}")
        if i >= 3:  # warm-up rounds off the record
            last_s.append(t1 - t0)
            first_s.append(t1 - t_first)
            routes.add(st.route_note or st.path)
    return {
        "chunks": chunks,
        "aux": aux,
        "streamed": streamed,
        "receiver_page_size": page,
        "receiver_page_layout": page_layout,
        "last_chunk_to_done": summarize(last_s),
        "first_chunk_to_done": summarize(first_s),
        "routes": sorted(routes),
    }


def chunk_steps(logs: Path, shape: str) -> dict[str, float]:
    """Median ms of each step of ``shape``'s cross-node chunks ("lane chunk" DEBUG lines,
    csrc/state.h ChunkTrace; one clock for both services): the sender's pack, post, WRITE (post
    to seen done), note (done to sent); the note's way (sent to read), the receiver's wait
    before unpacking, unpack and answer; ``between``: one chunk's pack start to the next's."""
    send: dict[tuple[str, int], list[float]] = {}
    recv: dict[tuple[str, int], list[float]] = {}
    for f in sorted(logs.glob("svc*.log")):
        for line in f.read_text().splitlines():
            if '"lane chunk"' not in line or f'"transfer_id": "{shape}-' not in line:
                continue
            rec = json.loads(line)
            (send if rec["side"] == "send" else recv)[(rec["transfer_id"], rec["first"])] = rec["t"]
    steps: dict[str, list[float]] = {}

    def add(name: str, a: float, b: float) -> None:
        if a and b:
            steps.setdefault(name, []).append((b - a) * 1e3)

    for k, s in send.items():
        for name, i in (("pack", 0), ("post", 1), ("write", 2), ("note", 3)):
            add(name, s[i], s[i + 1])
        if (r := recv.get(k)) is not None:
            add("note_way", s[4], r[0])
            for name, i in (("wait", 0), ("unpack", 1), ("answer", 2)):
                add(name, r[i], r[i + 1])
    by_tid: dict[str, list[float]] = {}
    for (tid, _), s in sorted(send.items(), key=lambda kv: (kv[0][0], kv[1][0])):
        by_tid.setdefault(tid, []).append(s[0])
    for starts in by_tid.values():
        for a, b in zip(starts, starts[1:], strict=False):
            add("between", a, b)
    return {k: round(float(np.median(v)), 4) for k, v in steps.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cross", action="store_true", help="two services (cross-node routes)")
    ap.add_argument("--shapes", default="c1,c2,c8,c1+aux,c2+aux,s32")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--pool-pages", type=int, default=256)
    ap.add_argument("--compute-us", type=float, default=200.0, help="between streamed chunks")
    ap.add_argument("--small", action="store_true", help="CI sizes (the figures then mean nothing)")
    ap.add_argument("--out", default="/tmp/bench-shapes")
    ap.add_argument("--profile", metavar="DIR", help="services log at DEBUG here; rows get chunk steps")
    ap.add_argument(
        "--peer-auth",
        choices=PEER_AUTHS,
        default="local",
        help="with --cross: how the two services prove themselves to each other (_harness.Services)",
    )
    args = ap.parse_args()
    if args.small:
        args.shapes, args.iters = "c1,c2,c1+aux,s4+aux,c2@p1,c2+aux@p64,c2+aux@nhc", 5
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        _parse(s)
    lay = _layout(args.pool_pages)
    dev: str | int = 0 if args.device == "cuda" else "cpu"
    rows: dict[str, Any] = {}
    # --cross: the cross-node routes between two services of one host (not their same-host route)
    env = {"KVSERVICE_SAME_HOST_ROUTE": "off"} if args.cross else {}
    logs = Path(args.profile) if args.profile else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        env |= {"KVSERVICE_LOG_LEVEL": "DEBUG", "KVSERVICE_LOG_FORMAT": "json"}
    auth = args.peer_auth if args.cross else "local"
    with Services(2 if args.cross else 1, env, log_dir=logs, peer_auth=auth) as svc:
        a, b = svc.addresses[0], svc.addresses[-1]
        peer = svc.peer_addresses[-1]
        sender = svc.peer_addresses[0] if args.cross else ""
        # the receiver: one pool of the same bytes per page size and page layout the shapes name
        kinds = sorted({_parse(s)[3:] for s in shapes})
        rlays = {k: _layout(args.pool_pages * PAGE // k[0], *k) for k in kinds}
        sp = KVPool(lay, dev, 1)
        rps = {p: KVPool(rl, dev, 2 + i) for i, (p, rl) in enumerate(rlays.items())}
        segs = [shared_memory.SharedMemory(create=True, size=AUX_ROW * AUX_ROWS) for _ in range(1 + len(rps))]
        try:
            aux = [[AuxSpec("meta", shm_region(s.name, AUX_ROW * AUX_ROWS), AUX_ROW, AUX_ROWS)] for s in segs]
            with Client(a, client_name="shape-tx") as ka, Client(b, client_name="shape-rx") as kb:
                sb = ka.register_buffers(lay, *sp.regions(), aux=aux[0]).buffer_set_id
                rbs = {
                    p: kb.register_buffers(rlays[p], *rp.regions(), aux=aux[1 + i]).buffer_set_id
                    for i, (p, rp) in enumerate(rps.items())
                }
                for s in shapes:
                    rb = rbs[_parse(s)[3:]]
                    rows[s] = run_shape(
                        ka, kb, sb, rb, peer, sender, s, args.iters, args.pool_pages, args.compute_us * 1e-6
                    )
                    r = rows[s]
                    print(
                        f"{s:>10}: last chunk -> DONE p50 {r['last_chunk_to_done']['p50_ms']:.3f} ms "
                        f"({', '.join(r['routes'])})",
                        file=sys.stderr,
                    )
        finally:
            sp.close()
            for rp in rps.values():
                rp.close()
            for s in segs:
                s.close()
                s.unlink()
    if logs is not None:  # the services have stopped: their logs are whole
        for s in shapes:
            rows[s]["chunk_steps_ms"] = chunk_steps(logs, s)
    ref = rows.get("c1", {}).get("last_chunk_to_done", {}).get("p50_ms")
    report = {
        "benchmark": "shapes",
        "what": "SendDelta of the last chunk -> receiver DONE, one 64 KiB page a chunk",
        "device": args.device,
        "cross": args.cross,
        "peer_auth": auth,
        "page_bytes": lay.page_bytes_all_layers,
        "shapes": rows,
        "baselines": {"one_chunk": rows["c1"]["last_chunk_to_done"]} if "c1" in rows else {},
        "lane_stats": lane_stats(logs) if logs is not None else {},
        "vs_one_chunk": {
            s: round(r["last_chunk_to_done"]["p50_ms"] / ref, 2) for s, r in rows.items() if ref
        },
    }
    tag = f"shapes_{'cross' if args.cross else 'same_node'}_{args.device}"
    write_json(args.out, tag, report)


if __name__ == "__main__":
    main()
