"""EventSubscriber over real ZMQ sockets: canonical mapping, gaps with replay, bad input."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from engine_schemas import removed, sglang_structs, stored, vllm_structs
from kvservice_client.hashing import page_hashes

from kvservice.index import PrefixIndex
from kvservice.index.events import EventSubscriber, StreamConfig

PS = 4


class Publisher:
    """An engine-side publisher: XPUB (PUB-compatible, reports subscriptions) + replay ROUTER."""

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def wait_subscriber(self) -> None:
        assert self.pub.poll(5000), "no subscription arrived"
        self.pub.recv()

    def send(self, batch: Any, *, drop: bool = False) -> None:
        """Publish (or, with drop, only buffer: the subscriber misses it) the next batch."""
        payload = msgspec.msgpack.encode(batch)
        self.buffer.append((self.seq, payload))
        if not drop:
            self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if self.router.poll(50):
                ident, _, start = self.router.recv_multipart()
                for seq, buf in self.buffer:
                    if seq >= int.from_bytes(start, "big"):
                        self.router.send_multipart([ident, b"", seq.to_bytes(8, "big"), buf])
                self.router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(linger=0)
        self.router.close(linger=0)


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


def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.time() + timeout
    while not pred():
        assert time.time() < end, "timed out"
        time.sleep(0.01)


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
    until(lambda: sub.last_seq == 1)
    assert matched(ix, tokens) == 5
    pub.send(s["batch"](ts=0.0, events=[removed(s, [eh[3]])]))
    until(lambda: sub.last_seq == 2)
    assert matched(ix, tokens) == 3
    pub.send(s["batch"](ts=0.0, events=[s["cleared"]()]))
    until(lambda: sub.last_seq == 3)
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
    until(lambda: sub.last_seq == 2)
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
    until(lambda: sub.last_seq == 3)
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
    until(lambda: sub.last_seq == 0)
    assert sub.counters["skipped_lora"] == 1 and ix.indexed_pages("ev") == 0
    sub.stop()


def test_publisher_restart_resets_stream(pub: Publisher) -> None:
    """A sequence number that goes back means a restarted engine: its entries are dropped."""
    s = sglang_structs()
    ix = PrefixIndex()
    sub = subscribe(ix, pub)
    pub.send(s["batch"](ts=0.0, events=[stored(s, [1], None, list(range(PS)), PS)]))
    pub.send(s["batch"](ts=0.0, events=[stored(s, [2], 1, list(range(PS, 2 * PS)), PS)]))
    until(lambda: sub.last_seq == 1)
    pub.seq = 0
    pub.send(s["batch"](ts=0.0, events=[stored(s, [9], None, list(range(50, 50 + PS)), PS)]))
    until(lambda: sub.counters["restarts"] == 1 and sub.last_seq == 0)
    assert ix.indexed_pages("ev") == 1
    sub.stop()


def test_engine_scheme_indexes_opaque_hashes(pub: Publisher) -> None:
    """With scheme="engine" the engine's int hashes are the index keys (match with page_size=0)."""
    s = sglang_structs()
    ix = PrefixIndex()
    sub = subscribe(ix, pub, scheme="engine")
    pub.send(s["batch"](ts=0.0, events=[stored(s, [7, 8], None, list(range(2 * PS)), PS)]))
    until(lambda: sub.last_seq == 0)
    assert ix.match(np.array([7, 8, 9], np.uint64), page_size=0)[0].matched_pages == 2
    sub.stop()
