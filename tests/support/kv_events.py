"""An engine's KV-event publisher in tests: ZMQ XPUB for the live stream, a ROUTER for replays."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import zmq

__all__ = ["Publisher"]


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
