"""Re-publish this node's prefix index as vLLM-format KV events (ZMQ PUB + replay ROUTER).

Routers built for vLLM's KV events (llm-d's indexer, Dynamo-style routers, another kvservice)
can then follow every page this service knows — pages engines published through the SDK, pages
that arrived by transfer, pages ingested from engines' own events — as if it were one vLLM::

    index.publish(bs, hashes, parent, tokens)  ->  BlockStored(block_hashes=hashes,
                                                   parent_block_hash=parent, token_ids=tokens,
                                                   block_size=page size, medium="GPU", ...)
    index evictions / buffer set removal       ->  BlockRemoved(block_hashes=every hash that went)
    host tier stores / evictions               ->  the same with medium="CPU" (streams of every engine)

Wire, exactly as vLLM 0.32's ZmqEventPublisher: PUB frames ``(topic, seq u64 BE, msgpack
[ts, [events], dp_rank])`` with map-encoded events tagged ``"type"``; a ROUTER answers
``(b"", start_seq)`` with ``(b"", topic, seq, batch)`` for every buffered batch from start and
ends with ``(b"", b"", -1, b"")``. Block hashes are our canonical page hashes (u64 ints), so a
subscriber can match them directly (kvservice: ``"scheme": "engine"``) or recompute them from
``token_ids`` (``"canonical"``). Pages published by hash only carry empty ``token_ids``.

One stream per configured endpoint; ``engine_id`` narrows it to that engine's buffer sets
(vLLM's format has no engine field, so one stream per engine is how a router tells them apart).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from itertools import count
from typing import Any, Protocol

import msgpack
import numpy as np
import zmq

from ..base import BufferSetSpec

__all__ = ["EventRepublisher", "RepublishConfig"]

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _Paged(Protocol):  # the tier's LayoutKey, as far as an event needs it
    @property
    def page_size(self) -> int: ...


def _block_stored(
    hashes: np.ndarray, parent: int | None, tokens: list[int], block_size: int, medium: str
) -> dict[str, Any]:
    """vLLM's BlockStored event, map-encoded."""
    n = int(hashes.size)
    return {
        "type": "BlockStored",
        "block_hashes": hashes.tolist(),
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": [None] * n,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def _block_removed(hashes: np.ndarray, medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes.tolist(), "medium": medium, "group_idx": 0}


@dataclasses.dataclass(frozen=True)
class RepublishConfig:
    endpoint: str  # bind address of the PUB socket, e.g. "tcp://*:5600"
    replay_endpoint: str | None = None  # bind address of the ROUTER answering replay requests
    topic: str = "kv"
    engine_id: str = "*"  # "*": every buffer set on the node
    buffer_steps: int = 10_000  # batches kept for replay


class EventRepublisher:
    """An IndexListener that sends vLLM-format batches from a thread of its own."""

    def __init__(self, config: RepublishConfig) -> None:
        self.config = config
        self._queue: queue.SimpleQueue[list[dict[str, Any]] | None] = queue.SimpleQueue()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._topic = config.topic.encode()
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self.batches = 0
        # NOTE: read once here; the sockets belong to the thread from now on.
        self.endpoints: tuple[str, str | None] = (
            self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None,
        )
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-republish")
        self._thread.start()

    # -- IndexListener (called under the index lock: build the event, enqueue, return) ------
    def _wanted(self, spec: BufferSetSpec) -> bool:
        return self.config.engine_id in ("*", spec.engine_id)

    def stored(
        self, spec: BufferSetSpec, hashes: np.ndarray, parent: int | None, tokens: np.ndarray | None
    ) -> None:
        if not self._wanted(spec) or hashes.size == 0:
            return
        n = int(hashes.size)
        full = tokens is not None and tokens.size >= n * spec.page_size
        kept = tokens[: n * spec.page_size].tolist() if full else []  # type: ignore[index]
        self._queue.put([_block_stored(hashes, parent, kept, spec.page_size, "GPU")])

    def removed(self, spec: BufferSetSpec, hashes: np.ndarray) -> None:
        if self._wanted(spec) and hashes.size:
            self._queue.put([_block_removed(hashes, "GPU")])

    # -- TierListener (the node's host tier: node-wide, so only on a stream of every engine) ----
    def tier_stored(self, key: _Paged, hashes: np.ndarray) -> None:
        """Pages the host tier now holds, as vLLM's offloading connector reports them: medium
        "CPU", no parent (the tier keeps pages, not chains), no token ids."""
        if self.config.engine_id == "*" and hashes.size:
            self._queue.put([_block_stored(hashes, None, [], key.page_size, "CPU")])

    def tier_removed(self, key: _Paged, hashes: np.ndarray) -> None:
        if self.config.engine_id == "*" and hashes.size:
            self._queue.put([_block_removed(hashes, "CPU")])

    # -- the thread ---------------------------------------------------------------------------
    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    events = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if events is None:
                    return
                while True:  # coalesce what is queued into one batch, as an engine step does
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self._queue.put(None)
                        break
                    events += more
                self._send(events)
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, events: list[dict[str, Any]]) -> None:
        seq = next(self._seq)
        payload = msgpack.packb([time.time(), events, 0])
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self.batches += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events republish: invalid replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
