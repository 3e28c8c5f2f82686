"""Multi-turn transfer demo on the CPU default: two kvservice processes, two engine processes.

    router (this process)
      ├── kvservice "prefill node" (python -m kvservice, NIXL over UCX on DRAM; with
      │   --same-host the two services map each other's pools and copy page to page: FUSED)
      ├── kvservice "decode node"
      ├── prefill engine process: KV pool in POSIX shm, "computes" KV, SendDelta
      └── decode engine process:  KV pool in POSIX shm, MatchPrefix → ExpectDelta → verify

Each turn extends one chat session (previous context + answer + new user message). The
decode engine asks its service which leading pages it already holds, declares only the rest,
the prefill engine sends the whole sequence and the services move only the delta. KV bytes
are a deterministic function of the page's prefix hash, so the decode engine can verify every
page it received byte for byte.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

LAYOUT_ARGS = dict(
    num_layers=8, page_size=16, num_pages=512, total_kv_heads=8, head_dim=128, dtype="bfloat16"
)


def _content(pool: Any, hashes: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Synthetic KV per layer, (layer, K bytes, V bytes): a function of each page's prefix hash."""
    words = pool.layout.page_bytes_k // 8
    base = hashes.astype(np.uint64)[:, None] ^ np.arange(words, dtype=np.uint64)[None, :]
    for layer in range(pool.layout.num_layers):  # per layer, vectorised over pages
        salt = np.uint64(0x9E3779B97F4A7C15 * (layer + 1) % 2**64)
        yield layer, (base ^ salt).view(np.uint8), (base ^ ~salt).view(np.uint8)


def _fill(pool: Any, pages: np.ndarray, hashes: np.ndarray) -> None:
    """Write the synthetic KV of sequence pages ("prefill")."""
    for layer, k, v in _content(pool, hashes):
        pool.k(layer)[pages] = k
        pool.v(layer)[pages] = v


def _expected_ok(pool: Any, pages: np.ndarray, hashes: np.ndarray) -> bool:
    return all(
        np.array_equal(pool.k(layer)[pages], k) and np.array_equal(pool.v(layer)[pages], v)
        for layer, k, v in _content(pool, hashes)
    )


def _engine(role: str, address: str, conn: Any) -> None:
    """An engine process: owns a shm KV pool, talks to its local kvservice, obeys the router."""
    from kvservice_client import Client, Layout, ShmKVPool, page_hashes

    layout = Layout.mha(**LAYOUT_ARGS)  # type: ignore[arg-type]
    pool = ShmKVPool.create(layout)
    free = list(range(layout.num_pages))[::-1]
    try:
        with Client(address, client_name=f"demo-{role}") as kv:
            bs = kv.register_buffers(
                layout, pool.k_regions, pool.v_regions, engine_id=f"demo-{role}"
            ).buffer_set_id
            conn.send(("ready", bs))
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                if role == "decode" and msg[0] == "expect":
                    _, tid, tokens = msg
                    n = len(tokens) // layout.page_size
                    m = kv.match_prefix(
                        tokens=tokens, page_size=layout.page_size, buffer_set_ids=[bs], lease_ttl_ms=30_000
                    )
                    hit = m.matches[0].matched_pages if m.matches else 0
                    prefix_pages = list(m.matches[0].page_indices) if hit else []
                    dst = [free.pop() for _ in range(n - hit)]
                    kv.expect_delta(
                        tid,
                        bs,
                        prefix_pages=hit,
                        dst_page_indices=dst,
                        publish_tokens=tokens,
                        prefix_page_indices=prefix_pages,
                        deadline_ms=60_000,
                    )
                    conn.send(("expected", hit, n))
                    (st,) = kv.wait(tid, timeout=60)
                    if m.lease_id:
                        kv.release_lease(m.lease_id)
                    hashes = page_hashes(tokens, layout.page_size)
                    ok = _expected_ok(pool, np.array(prefix_pages + dst, dtype=np.int64), hashes)
                    conn.send(
                        (
                            "done",
                            st.state,
                            st.error,
                            st.pages_sent,
                            st.pages_skipped,
                            st.bytes_sent,
                            ok,
                            st.timings_us["total"],
                        )
                    )
                elif role == "prefill" and msg[0] == "send":
                    _, tid, tokens, peer = msg
                    hashes = page_hashes(tokens, layout.page_size)
                    pages = np.array([free.pop() for _ in range(hashes.size)], dtype=np.int64)
                    _fill(pool, pages, hashes)  # "prefill": compute KV of the whole sequence
                    half = pages.size // 2  # two chunks, as chunked prefill would send them
                    kv.send_delta(tid, bs, src_page_indices=pages[:half], peer_address=peer, last_chunk=False)
                    kv.send_delta(
                        tid, bs, src_page_indices=pages[half:], chunk_offset=half, peer_address=peer
                    )
                    (st,) = kv.wait(tid, timeout=60)
                    free.extend(pages.tolist())  # prefill drops its copy once sent
                    conn.send(("sent", st.state, st.path, st.timings_us["total"]))
    finally:
        pool.close()


def _start_service(name: str, sock: str, same_host: bool) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "KVSERVICE_LOG_LEVEL": "WARNING",
        "KVSERVICE_LOG_FORMAT": "text",
        "KVSERVICE_SERVICE_NAME": name,
        # NOTE: both "nodes" run on this host; unless asked, they talk as two hosts would (NIXL)
        "KVSERVICE_SAME_HOST_ROUTE": "auto" if same_host else "off",
        "KVSERVICE_PEER_ALLOWLIST": "unix",  # KV goes only to peers on this host's sockets
    }
    return subprocess.Popen(
        [sys.executable, "-m", "kvservice", "serve", "--uds-path", sock], env=env, stdout=subprocess.DEVNULL
    )


def run_demo(turns: int = 4, same_host: bool = False) -> int:
    tmp = tempfile.mkdtemp(prefix="kvservice-demo-")
    socks = {n: os.path.join(tmp, f"{n}.sock") for n in ("prefill", "decode")}
    services = [_start_service(n, s, same_host) for n, s in socks.items()]
    ctx = mp.get_context("spawn")
    engines, conns = [], {}
    try:
        for n, s in socks.items():
            end = time.monotonic() + 60
            while not os.path.exists(s):
                if time.monotonic() > end or any(p.poll() is not None for p in services):
                    raise SystemExit(f"kvservice ({n}) did not start")
                time.sleep(0.05)
        for role in ("prefill", "decode"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_engine, args=(role, f"unix:{socks[role]}", child), daemon=True)
            proc.start()
            engines.append(proc)
            conns[role] = parent
            tag, bs = parent.recv()
            print(f"{role:7s} engine registered buffer set {bs} with kvservice at unix:{socks[role]}")
        page_bytes = _page_bytes()
        rng = np.random.default_rng(7)
        context = rng.integers(0, 32000, 2048).tolist()  # system prompt + first user message
        print(
            f"\n{'turn':>4} {'tokens':>7} {'pages':>6} {'held':>6} {'moved':>6} {'MiB moved':>10} "
            f"{'MiB saved':>10} {'path':>7} {'send ms':>8}  verified"
        )
        total_moved = total_full = 0
        ok_all = True
        for turn in range(1, turns + 1):
            tid = f"demo-turn-{turn}"
            conns["decode"].send(("expect", tid, context))
            _, held, n = conns["decode"].recv()
            conns["prefill"].send(("send", tid, context, f"unix:{socks['decode']}"))
            _, sstate, path, us = conns["prefill"].recv()
            _, state, err, sent, skipped, nbytes, ok, _ = conns["decode"].recv()
            ok_all &= ok and state == "DONE" and sstate == "DONE"
            total_moved += nbytes
            total_full += n * page_bytes
            print(
                f"{turn:>4} {len(context):>7} {n:>6} {held:>6} {sent:>6} {nbytes / 2**20:>10.1f} "
                f"{skipped * page_bytes / 2**20:>10.1f} {path:>7} {us / 1000:>8.1f}  {'yes' if ok else 'NO'}"
                + (f"  {state}: {err}" if state != "DONE" else "")
            )
            context += rng.integers(0, 32000, 256).tolist()  # the model's answer
            context += rng.integers(0, 32000, 512).tolist()  # the next user message
        print(
            f"\nbytes moved {total_moved / 2**20:.1f} MiB of {total_full / 2**20:.1f} MiB "
            f"({100 * (1 - total_moved / max(total_full, 1)):.0f}% saved by prefix reuse); "
            f"every received page verified: {'yes' if ok_all else 'NO'}"
        )
        return 0 if ok_all else 1
    finally:
        for c in conns.values():
            c.send(("stop",))
        for p in engines:
            p.join(10)
        for svc in services:
            svc.terminate()
        for svc in services:
            try:  # a first start's native build may still run; its stop waits for it
                svc.wait(60)
            except subprocess.TimeoutExpired:
                svc.kill()


def _page_bytes() -> int:
    from kvservice_client import Layout

    return Layout.mha(**LAYOUT_ARGS).page_bytes_all_layers  # type: ignore[arg-type]
