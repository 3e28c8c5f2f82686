"""The KV-event stream a real vLLM 0.32 published (recorded byte for byte by
record_vllm_events.py), replayed into the subscriber without vLLM: runs everywhere."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import numpy as np
from kvservice_client.hashing import page_hashes

from kvservice.index.events import EventSubscriber, StreamConfig, decode_batch
from kvservice.index.prefix_index import PrefixIndex

REC = json.loads((Path(__file__).resolve().parents[2] / "vectors" / "vllm-0.32-kv-events.json").read_text())
FRAMES = [[base64.b64decode(x) for x in f] for f in REC["frames"]]
BLOCK = REC["block_size"]


def _matched(ix: PrefixIndex, tokens: list[int]) -> int:
    h = page_hashes(np.array(tokens, np.uint32), BLOCK)
    return max((m.matched_pages for m in ix.match(h, page_size=BLOCK)), default=0)


def _replay(n: int) -> tuple[PrefixIndex, EventSubscriber]:
    ix = PrefixIndex()
    ix.add_buffer_set("ev", engine_id="vllm", page_size=BLOCK, num_pages=0, presence_only=True)
    sub = EventSubscriber(ix, StreamConfig("tcp://127.0.0.1:1", "ev", BLOCK, topic="kv"))
    for f in FRAMES[:n]:
        sub.handle(f)
    ix.check_integrity()
    return ix, sub


def test_recorded_payloads_have_the_shape_the_decoder_documents() -> None:
    """Array batch [ts, events, dp], map events tagged "type", per-block extra_keys of None."""
    for f in FRAMES:
        raw = msgpack.unpackb(f[2], raw=False)
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
        for ev in raw[1]:
            if ev["type"] == "BlockStored":
                assert ev["extra_keys"] == [None] * len(ev["block_hashes"])
                assert ev["medium"] == "GPU" and ev["kv_cache_spec_kind"] == "full_attention"
        assert decode_batch(f[2]).unknown_events == 0


def test_every_stored_block_is_found_then_evictions_and_reset_apply() -> None:
    """After the two prompts every full block matches; the fills evict them; reset clears all."""
    p = REC["prompts"]
    ix, sub = _replay(2)
    assert _matched(ix, p["a"]) == len(p["a"]) // BLOCK and _matched(ix, p["b"]) == len(p["b"]) // BLOCK
    ix, sub = _replay(6)
    assert sub.counters["blocks_removed"] > 0 and _matched(ix, p["fill"][-1]) == 8
    assert _matched(ix, p["a"]) == 0
    ix, sub = _replay(7)
    assert ix.indexed_pages("ev") == len(p["last"]) // BLOCK == _matched(ix, p["last"])
    assert sub.counters["event_errors"] == 0 and sub.counters["skipped_extra_keys"] == 0
