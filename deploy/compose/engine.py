"""A stand-in inference engine for the compose demo (no model: KV bytes are synthetic).

    python engine.py --role decode  --address unix:/run/kvservice/kvservice.sock
    python engine.py --role prefill --address unix:/run/kvservice/kvservice.sock --peer kvservice-decode:50052

Both roles walk the same deterministic schedule of chat sessions (``--seed``), one transfer per
turn with id ``<run>-s<session>-t<turn>``, so they need no channel besides kvservice itself:
the decode engine asks its service which prefix pages it holds (MatchPrefix), declares the rest
(ExpectDelta), waits and verifies the bytes; the prefill engine "computes" the whole sequence
and sends it (SendDelta, two chunks) — its service moves only the pages the decode side lacks.
Runs until killed (or ``--sessions`` sessions), ``--pause`` seconds between turns, so a
dashboard always has traffic.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from kvservice_client import Client, KVClientError, Layout, ShmKVPool, page_hashes

LAYOUT = Layout.mha(
    num_layers=8, page_size=16, num_pages=512, total_kv_heads=8, head_dim=128, dtype="bfloat16"
)
TURNS = 6  # per session; the context grows by ~2 pages of answer and ~2 of new message per turn


def _content(pool: ShmKVPool, hashes: np.ndarray, layer: int, v: bool) -> np.ndarray:
    """Bytes of the given pages in one layer: a function of the page's chain hash only."""
    words = pool.layout.page_bytes_k // 8
    salt = np.uint64((0x9E3779B97F4A7C15 * (layer + 1) + v) % 2**64)
    return ((hashes.astype(np.uint64)[:, None] ^ np.arange(words, dtype=np.uint64)[None, :]) ^ salt).view(
        np.uint8
    )


def _schedule(seed: int, session: int) -> list[list[int]]:
    """Token lists of every turn of one session (each extends the previous one)."""
    rng = np.random.default_rng([seed, session])
    context = rng.integers(0, 32000, 1024).tolist()
    turns = [list(context)]
    for _ in range(TURNS - 1):
        context += rng.integers(0, 32000, 64).tolist()
        turns.append(list(context))
    return turns


def _decode_turn(kv: Client, pool: ShmKVPool, bs: str, tid: str, tokens: list[int]) -> str:
    n = len(tokens) // LAYOUT.page_size
    m = kv.match_prefix(tokens=tokens, page_size=LAYOUT.page_size, buffer_set_ids=[bs], lease_ttl_ms=60_000)
    held = m.matches[0].matched_pages if m.matches else 0
    prefix = list(m.matches[0].page_indices) if held else []
    used = set(prefix)
    dst = [p for p in range(LAYOUT.num_pages) if p not in used][: n - held]
    kv.expect_delta(
        tid,
        bs,
        prefix_pages=held,
        dst_page_indices=dst,
        publish_tokens=tokens,
        prefix_page_indices=prefix,
        deadline_ms=60_000,
    )
    (st,) = kv.wait(tid, timeout=90)
    if m.lease_id:
        kv.release_lease(m.lease_id)
    hashes = page_hashes(tokens, LAYOUT.page_size)
    pages = np.array(prefix + dst, dtype=np.int64)
    ok = all(np.array_equal(pool.k(layer)[pages], _content(pool, hashes, layer, False)) for layer in range(8))
    return f"{st.state} held={held} moved={st.pages_sent} verified={ok}"


def _prefill_turn(kv: Client, pool: ShmKVPool, bs: str, tid: str, tokens: list[int], peer: str) -> str:
    hashes = page_hashes(tokens, LAYOUT.page_size)
    pages = np.arange(hashes.size, dtype=np.int64)
    for layer in range(LAYOUT.num_layers):
        pool.k(layer)[pages] = _content(pool, hashes, layer, False)
        pool.v(layer)[pages] = _content(pool, hashes, layer, True)
    half = pages.size // 2  # two chunks, as chunked prefill would send them
    kv.send_delta(
        tid, bs, src_page_indices=pages[:half], peer_address=peer, last_chunk=False, deadline_ms=60_000
    )
    kv.send_delta(
        tid, bs, src_page_indices=pages[half:], chunk_offset=half, peer_address=peer, deadline_ms=60_000
    )
    (st,) = kv.wait(tid, timeout=90)
    return f"{st.state} path={st.path} sent={st.pages_sent} skipped={st.pages_skipped}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--address", default="unix:/run/kvservice/kvservice.sock", help="the local kvservice")
    ap.add_argument("--peer", default="", help="prefill: the decode node's kvservice (host:port)")
    ap.add_argument("--run", default="demo", help="prefix of transfer ids (same on both roles)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--sessions", type=int, default=0, help="stop after this many sessions (0: never)")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between turns")
    args = ap.parse_args(argv)
    if args.role == "prefill" and not args.peer:
        ap.error("--peer is required for --role prefill")
    pool = ShmKVPool.create(LAYOUT)
    try:
        with Client(args.address, client_name=f"compose-{args.role}") as kv:
            bs = kv.register_buffers(
                LAYOUT, pool.k_regions, pool.v_regions, engine_id=args.role
            ).buffer_set_id
            print(f"{args.role}: buffer set {bs} on {args.address}", flush=True)
            session = 0
            while not args.sessions or session < args.sessions:
                if args.role == "decode":
                    kv.evict_pages(bs, all=True)  # a new session starts from an empty cache
                for turn, tokens in enumerate(_schedule(args.seed, session)):
                    tid = f"{args.run}-s{session}-t{turn}"
                    try:
                        if args.role == "decode":
                            line = _decode_turn(kv, pool, bs, tid, tokens)
                        else:
                            line = _prefill_turn(kv, pool, bs, tid, tokens, args.peer)
                    except KVClientError as exc:  # keep the demo going; the dashboard shows failures
                        line = f"error {type(exc).__name__}: {exc}"
                    print(f"{args.role} {tid}: {line}", flush=True)
                    time.sleep(args.pause)
                session += 1
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
