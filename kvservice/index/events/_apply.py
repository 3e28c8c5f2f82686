"""Apply decoded KV events of one engine stream to a presence-only buffer set of the index.

Mapping (events name blocks by the engine's hash, never by page index)::

    BlockStored(block_hashes [b1, b2], parent b0, token_ids t[0 : 2*block_size])
        canonical parent  c0 = known[b0]  (root when b0 is nil)
        canonical hashes  c1, c2 = page_hashes(t, block_size, seed, parent=c0)
        index             publish(presence-only set, [c1, c2], parent_hash=c0)
        known            += {b1: c1, b2: c2}
    BlockRemoved([b])     evict_hashes([known[b]]) (and below); forget b
    AllBlocksCleared      evict_all; forget everything

The buffer set is presence-only: routers get matched page counts for engines that publish
events, with empty page indices (vLLM's block ids are not in its events). With
``scheme="engine"`` the engine's own int hashes are indexed as opaque hashes instead (match
them with ``page_size=0``). Events the canonical scheme cannot represent are skipped and
counted: LoRA blocks, blocks with extra keys (multimodal, cache salt), other media than GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Literal

import numpy as np
from kvservice_client.hashing import page_hashes

from kvservice.errors import KVServiceError

from ..prefix_index import PrefixIndex
from ._decode import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch

log = logging.getLogger(__name__)
_M64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """One engine's event stream and the presence-only buffer set it feeds."""

    endpoint: str
    buffer_set_id: str
    page_size: int
    replay_endpoint: str | None = None
    topic: str = ""
    scheme: Literal["canonical", "engine"] = "canonical"
    seed: int = 0
    media: tuple[str | None, ...] = (None, "GPU", "gpu")


class EventApplier:
    """Keeps ``engine hash -> canonical hash`` for one stream and applies batches to the index."""

    def __init__(self, index: PrefixIndex, config: StreamConfig) -> None:
        self.index, self.config = index, config
        self.known: dict[BlockHash, int] = {}
        self.counters: collections.Counter[str] = collections.Counter()

    def reset(self) -> None:
        """The engine's cache state is unknown (restart): drop what the stream told us."""
        self.known.clear()
        self.index.evict_all(self.config.buffer_set_id)

    def apply(self, batch: EventBatch) -> None:
        self.counters["batches"] += 1
        self.counters["unknown_events"] += batch.unknown_events
        for ev in batch.events:
            try:
                if isinstance(ev, BlockStored):
                    self._stored(ev)
                elif isinstance(ev, BlockRemoved):
                    if ev.medium in self.config.media:
                        hs = [self.known.pop(b) for b in ev.block_hashes if b in self.known]
                        self.index.evict_hashes(self.config.buffer_set_id, np.array(hs, np.uint64))
                elif isinstance(ev, AllBlocksCleared):
                    self.reset()
                self.counters["events"] += 1
            except (KVServiceError, ValueError) as e:
                self.counters["event_errors"] += 1
                log.warning("kv event from %s skipped: %s", self.config.endpoint, e)

    def _stored(self, ev: BlockStored) -> None:
        c = self.config
        if ev.lora_id is not None or ev.lora_name is not None or ev.extra_keys or ev.medium not in c.media:
            self.counters["unsupported_events"] += 1
            return
        if ev.block_size != c.page_size:
            raise ValueError(f"block_size {ev.block_size} != page size {c.page_size} of {c.buffer_set_id}")
        if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
            raise ValueError(f"{len(ev.token_ids)} token ids for {len(ev.block_hashes)} blocks")
        parent: int | None = None
        if ev.parent_block_hash is not None:
            if ev.parent_block_hash not in self.known:
                raise ValueError("parent block is unknown (stored before we subscribed?)")
            parent = self.known[ev.parent_block_hash]
        if c.scheme == "canonical":
            hashes = page_hashes(np.array(ev.token_ids, np.uint32), c.page_size, c.seed, parent=parent or 0)
        else:
            hashes = np.array([_opaque(b) for b in ev.block_hashes], np.uint64)
        self.index.publish(c.buffer_set_id, hashes, None, 0, parent_hash=parent)
        self.known.update(zip(ev.block_hashes, hashes.tolist(), strict=True))


def _opaque(h: BlockHash) -> int:
    """An engine hash as u64: ints modulo 2**64, bytes by their first 8 bytes big-endian."""
    return int.from_bytes(h[:8], "big") if isinstance(h, bytes) else h & _M64
