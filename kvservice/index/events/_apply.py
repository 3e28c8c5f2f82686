"""Apply decoded KV events of one engine stream to a presence-only buffer set of the index.

Mapping (events name blocks by the engine's hash, never by page index)::

    BlockStored(block_hashes [b1, b2], parent b0, token_ids t[0 : 2*block_size], group g)
        canonical parent  c0 = known[g, b0]  (root when b0 is nil)
        canonical hashes  c1, c2 = page_hashes(t, block_size, seed, parent=c0)
        index             publish(presence-only set, [c1, c2], parent_hash=c0)
        known            += {(g, b1): c1, (g, b2): c2}
    BlockRemoved([b], g)  evict_hashes([known[g, b]]) (and below); forget (g, b)
    AllBlocksCleared      evict_all; forget everything

The buffer set is presence-only: routers get matched page counts for engines that publish
events, with empty page indices (vLLM's block ids are not in its events). With
``scheme="engine"`` the engine's own int hashes are indexed as opaque hashes instead (match
them with ``page_size=0``).

What is indexed, what is skipped (and counted, never silently)::

    kv_cache_spec_kind   full_attention (or unset)  -> indexed, per group; removal from any
                         full-attention group drops the page (a prefix hit needs every group)
                         other kinds (sliding_window, mamba, ...) -> skipped_other_kind
    medium               GPU (or unset) -> indexed;  CPU / STORAGE (offloaded) -> skipped_medium
    locality             LOCAL (or unset) -> indexed; REMOTE -> skipped_remote
    extra_keys           per block; a block with extra keys (multimodal, cache salt) and every
                         block after it in the chain -> skipped_extra_keys (their engine hashes
                         differ from any token-only hash, so indexing them would be wrong);
                         SGLang's cache_salt likewise (canonical scheme)
    LoRA (lora_id/name)  -> skipped_lora (the canonical hash has no adapter)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Literal

import numpy as np
from kvservice_client.hashing import chain_page_hashes, local_page_hashes

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


FULL_ATTENTION = (None, "full_attention")


class EventApplier:
    """Keeps ``(group, engine hash) -> canonical hash`` for one stream and applies batches."""

    def __init__(self, index: PrefixIndex, config: StreamConfig) -> None:
        self.index, self.config = index, config
        self.known: dict[tuple[int, BlockHash], int] = {}
        # Blocks we deliberately did not index: their descendants are skipped quietly too.
        self.unindexed: set[tuple[int, BlockHash]] = set()
        self.counters: collections.Counter[str] = collections.Counter()

    def reset(self) -> None:
        """The engine's cache state is unknown (restart): drop what the stream told us."""
        self.known.clear()
        self.unindexed.clear()
        self.index.evict_all(self.config.buffer_set_id)

    def apply(self, batch: EventBatch) -> None:
        self.counters["batches"] += 1
        self.counters["unknown_events"] += batch.unknown_events
        local = self._local_hashes(batch)
        for ev in batch.events:
            try:
                if isinstance(ev, BlockStored):
                    self._stored(ev, local.get(id(ev)))
                elif isinstance(ev, BlockRemoved):
                    self._removed(ev)
                elif isinstance(ev, AllBlocksCleared):
                    self.reset()
                self.counters["events"] += 1
            except (KVServiceError, ValueError) as e:
                self.counters["event_errors"] += 1
                log.warning("kv event from %s skipped: %s", self.config.endpoint, e)

    def _local_hashes(self, batch: EventBatch) -> dict[int, np.ndarray]:
        """Local page hashes of every well-formed BlockStored of the batch, in one vectorised call
        (chaining stays per event; the parents are only known in order)."""
        c = self.config
        if c.scheme != "canonical":
            return {}
        evs = [
            ev
            for ev in batch.events
            if isinstance(ev, BlockStored)
            and ev.block_size == c.page_size
            and ev.token_ids.size == len(ev.block_hashes) * c.page_size
        ]
        if not evs:
            return {}
        local = local_page_hashes(np.concatenate([ev.token_ids for ev in evs]), c.page_size, c.seed)
        bounds = np.cumsum([0] + [len(ev.block_hashes) for ev in evs])
        return {id(ev): local[bounds[i] : bounds[i + 1]] for i, ev in enumerate(evs)}

    def _skip_reason(self, medium: str | None, locality: str | None) -> str | None:
        if medium not in self.config.media:
            return "skipped_medium"
        if locality not in (None, "LOCAL"):
            return "skipped_remote"
        return None

    def _removed(self, ev: BlockRemoved) -> None:
        g = ev.group_idx or 0
        if self._skip_reason(ev.medium, ev.locality):
            return
        hs = []
        for b in ev.block_hashes:
            self.unindexed.discard((g, b))
            h = self.known.pop((g, b), None)
            if h is not None:
                hs.append(h)
        if hs:
            self.index.evict_hashes(self.config.buffer_set_id, np.array(hs, np.uint64))
            self.counters["blocks_removed"] += len(hs)

    def _stored(self, ev: BlockStored, local: np.ndarray | None) -> None:
        c, g, n = self.config, ev.group_idx or 0, len(ev.block_hashes)
        reason = self._skip_reason(ev.medium, ev.locality)
        if reason is None and ev.kv_cache_spec_kind not in FULL_ATTENTION:
            reason = "skipped_other_kind"
        if reason is None and (ev.lora_id is not None or ev.lora_name is not None):
            reason = "skipped_lora"
        if reason is None and ev.cache_salt is not None and c.scheme == "canonical":
            reason = "skipped_extra_keys"  # salted: the same tokens must not match across salts
        parent_key = (g, ev.parent_block_hash)
        if reason is None and ev.parent_block_hash is not None and parent_key in self.unindexed:
            reason = "skipped_extra_keys"  # a descendant of a block we could not index
        if reason is not None:
            self.counters[reason] += n
            if reason in ("skipped_lora", "skipped_extra_keys"):  # their descendants go unindexed too
                self.unindexed.update((g, b) for b in ev.block_hashes)
            return
        if ev.block_size != c.page_size:
            raise ValueError(f"block_size {ev.block_size} != page size {c.page_size} of {c.buffer_set_id}")
        if ev.token_ids.size != n * ev.block_size:
            raise ValueError(f"{ev.token_ids.size} token ids for {n} blocks")
        parent: int | None = None
        if ev.parent_block_hash is not None:
            if parent_key not in self.known:
                raise ValueError("parent block is unknown (stored before we subscribed?)")
            parent = self.known[parent_key]
        keyed = ev.block_has_extra_keys()
        usable = keyed.index(True) if True in keyed else n  # blocks before the first keyed one
        if usable < n:
            self.counters["skipped_extra_keys"] += n - usable
            self.unindexed.update((g, b) for b in ev.block_hashes[usable:])
        if usable == 0:
            return
        if c.scheme == "canonical":
            assert local is not None  # computed for every well-formed stored event
            hashes = chain_page_hashes(local[:usable], c.seed, parent=parent or 0)
        else:
            hashes = np.array([_opaque(b) for b in ev.block_hashes[:usable]], np.uint64)
        tokens = ev.token_ids[: usable * c.page_size] if c.scheme == "canonical" else None
        self.index.publish(c.buffer_set_id, hashes, None, 0, parent_hash=parent, tokens=tokens)
        self.known.update(zip(((g, b) for b in ev.block_hashes[:usable]), hashes.tolist(), strict=True))
        self.counters["blocks_stored"] += usable


def _opaque(h: BlockHash) -> int:
    """An engine hash as u64: ints modulo 2**64, bytes by their first 8 bytes big-endian."""
    return int.from_bytes(h[:8], "big") if isinstance(h, bytes) else h & _M64
