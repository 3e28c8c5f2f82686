"""EventSubscriber over real ZMQ sockets: canonical mapping, gaps with replay, bad input."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from kvservice_client.hashing import page_hashes

from kvservice.index import PrefixIndex
from kvservice.index.events import EventSubscriber, StreamConfig
from tests.support.engine_schemas import removed, sglang_structs, stored, vllm_structs
from tests.support.kv_events import Publisher
from tests.support.poll import eventually

PS = 4


@pytest.fixture
def pub() -> Iterator[Publisher]:
    p = Publisher()
    yield p
    p.close()


def subscribe(index: PrefixIndex, pub: Publisher, scheme: str = "canonical") -> EventSubscriber:
    index.add_buffer_set("ev", engine_id="vllm-0", page_size=PS, num_pages=0, presence_only=True)
    cfg = StreamConfig(f"tcp://127.0.0.1:{pub.port}", "ev", PS, f"tcp://127.0.0.1:{pub.rport}", scheme=scheme)  # type: ignore[arg-type]
    sub = EventSubscriber(index, cfg)
    sub.start()
    pub.wait_subscriber()
    return sub


def matched(index: PrefixIndex, tokens: np.ndarray) -> int:
    return index.match(page_hashes(tokens, PS), page_size=PS, buffer_set_ids=["ev"])[0].matched_pages


@pytest.mark.parametrize("engine", ["vllm-map", "vllm-array", "sglang"])
def test_stored_events_map_to_canonical_hashes(pub: Publisher, engine: str) -> None:
    """Blocks stored in two events (child under parent) match a canonical-hash query."""
    s = sglang_structs() if engine == "sglang" else vllm_structs(array_events=engine == "vllm-array")
    ix = PrefixIndex()
    sub = subscribe(ix, pub)
    tokens = np.arange(100, 100 + 5 * PS)
    eh = [1001, 1002, 1003, 1004, 1005] if engine == "sglang" else [bytes([i]) * 32 for i in range(1, 6)]
    pub.send(s["batch"](ts=0.0, events=[stored(s, eh[:2], None, tokens[: 2 * PS].tolist(), PS)]))
    pub.send(s["batch"](ts=0.0, events=[stored(s, eh[2:], eh[1], tokens[2 * PS :].tolist(), PS)]))
    eventually(lambda: sub.last_seq == 1)
    assert matched(ix, tokens) == 5
    pub.send(s["batch"](ts=0.0, events=[removed(s, [eh[3]])]))
    eventually(lambda: sub.last_seq == 2)
    assert matched(ix, tokens) == 3
    pub.send(s["batch"](ts=0.0, events=[s["cleared"]()]))
    eventually(lambda: sub.last_seq == 3)
    assert matched(ix, tokens) == 0 and ix.indexed_pages("ev") == 0
    ix.check_integrity()
    sub.stop()


def test_gap_is_replayed(pub: Publisher) -> None:
    """Batches the subscriber missed are fetched from the replay endpoint and applied in order."""
    s = vllm_structs(array_events=False)
    ix = PrefixIndex()
    sub = subscribe(ix, pub)
    tokens = np.arange(3 * PS)
    pub.send(s["batch"](ts=0.0, events=[stored(s, [1], None, tokens[:PS].tolist(), PS)]))
    pub.send(s["batch"](ts=0.0, events=[stored(s, [2], 1, tokens[PS : 2 * PS].tolist(), PS)]), drop=True)
    pub.send(s["batch"](ts=0.0, events=[stored(s, [3], 2, tokens[2 * PS :].tolist(), PS)]))
    eventually(lambda: sub.last_seq == 2)
    assert matched(ix, tokens) == 3
    assert sub.counters["gaps"] == 1 and sub.counters["replayed_batches"] == 1
    assert sub.counters["event_errors"] == 0
    ix.check_integrity()
    sub.stop()


def test_malformed_input_is_counted_and_changes_nothing(pub: Publisher) -> None:
    """Garbage payloads, bad frames and inconsistent events are counted; the index is unchanged."""
    s = vllm_structs(array_events=True)
    ix = PrefixIndex()
    sub = subscribe(ix, pub)
    pub.pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1\xc1"])
    pub.pub.send_multipart([b"", b"short"])
    pub.seq = 1
    pub.send(s["batch"](ts=0.0, events=[stored(s, [1], 999, list(range(PS)), PS)]))  # unknown parent
    pub.send(s["batch"](ts=0.0, events=[stored(s, [2], None, list(range(PS)), 2 * PS)]))  # wrong size
    pub.send(s["batch"](ts=0.0, events=[stored(s, [3, 4], None, list(range(PS)), PS)]))  # token count
    eventually(lambda: sub.last_seq == 3)
    c = sub.counters
    assert (c["malformed_batches"], c["malformed_messages"], c["event_errors"]) == (1, 1, 3)
    assert ix.indexed_pages("ev") == 0
    ix.check_integrity()
    sub.stop()


def test_lora_blocks_are_skipped(pub: Publisher) -> None:
    """LoRA blocks cannot be named by canonical hashes: skipped and counted."""
    s = vllm_structs(array_events=False)
    ix = PrefixIndex()
    sub = subscribe(ix, pub)
    ev = s["stored"](block_hashes=[1], parent_block_hash=None, token_ids=list(range(PS)), block_size=PS,
                     lora_id=7, medium="GPU", lora_name="a")  # fmt: skip
    pub.send(s["batch"](ts=0.0, events=[ev]))
    eventually(lambda: sub.last_seq == 0)
    assert sub.counters["skipped_lora"] == 1 and ix.indexed_pages("ev") == 0
    sub.stop()


def test_publisher_restart_resets_stream(pub: Publisher) -> None:
    """A sequence number that goes back means a restarted engine: its entries are dropped."""
    s = sglang_structs()
    ix = PrefixIndex()
    sub = subscribe(ix, pub)
    pub.send(s["batch"](ts=0.0, events=[stored(s, [1], None, list(range(PS)), PS)]))
    pub.send(s["batch"](ts=0.0, events=[stored(s, [2], 1, list(range(PS, 2 * PS)), PS)]))
    eventually(lambda: sub.last_seq == 1)
    pub.seq = 0
    pub.send(s["batch"](ts=0.0, events=[stored(s, [9], None, list(range(50, 50 + PS)), PS)]))
    eventually(lambda: sub.counters["restarts"] == 1 and sub.last_seq == 0)
    assert ix.indexed_pages("ev") == 1
    sub.stop()


def test_engine_scheme_indexes_opaque_hashes(pub: Publisher) -> None:
    """With scheme="engine" the engine's int hashes are the index keys (match with page_size=0)."""
    s = sglang_structs()
    ix = PrefixIndex()
    sub = subscribe(ix, pub, scheme="engine")
    pub.send(s["batch"](ts=0.0, events=[stored(s, [7, 8], None, list(range(2 * PS)), PS)]))
    eventually(lambda: sub.last_seq == 0)
    assert ix.match(np.array([7, 8, 9], np.uint64), page_size=0)[0].matched_pages == 2
    sub.stop()
