"""ZMQ subscriber for one engine's KV-event stream, with gap detection and replay.

Wire (vLLM and SGLang ``ZmqEventPublisher``): PUB messages of three frames ``(topic, seq as
8-byte big-endian, msgpack batch)``. Replay: a DEALER sends ``(b"", start_seq)`` to the
publisher's ROUTER, which answers ``(b"", seq, batch)`` for every buffered ``seq >= start`` and
ends with ``(b"", -1 as 8 signed bytes, b"")``.

    last applied seq = 41, received 44  ->  gap: replay from 42, apply 42, 43, then 44
    received seq <= last                ->  publisher restarted: reset the stream, apply
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
END_SEQ = -1


class EventSubscriber:
    """Runs one stream in a daemon thread: ``start()``, ``stop()``; ``counters`` for stats."""

    def __init__(self, index: PrefixIndex, config: StreamConfig, *, replay_timeout_s: float = 2.0) -> None:
        self.config = config
        self.applier = EventApplier(index, config)
        self.counters = self.applier.counters
        self.last_seq: int | None = None
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"kv-events-{config.buffer_set_id}"
        )
        self.ready = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self.ready.wait(5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        sub.connect(self.config.endpoint)
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

    def _replay(self, start: int, until: int) -> None:
        """Fetch and apply seqs [start, until) from the replay endpoint, when configured."""
        if not self.config.replay_endpoint:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.config.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(self._replay_timeout_ms):
                frames = dealer.recv_multipart()
                if len(frames) != 3:
                    self.counters["malformed_messages"] += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    return
                if start <= seq < until and (self.last_seq is None or seq == self.last_seq + 1):
                    self.counters["replayed_batches"] += 1
                    self._apply(seq, frames[2])
            self.counters["replay_timeouts"] += 1
        finally:
            dealer.close(linger=0)
