"""The prefix index as the servicers call it: page hashing, MatchPrefix (and its lease), publish,
eviction suggestions, and the KV-event streams in (vLLM/SGLang publishers) and out (re-published
as vLLM-format events). Buffer sets enter and leave the index with the registry's hooks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import numpy as np
from kvservice_client.hashing import page_hashes

from ..buffers import BufferRegistry, BufferSet
from ..config import Config
from ..errors import InvalidArgument, NotFound, ResourceExhausted, Unauthenticated
from .base import Lease, Match
from .prefix_index import PrefixIndex, as_hashes

if TYPE_CHECKING:
    from .events import EventRepublisher, EventSubscriber

__all__ = ["DuplicateChecks", "IndexCalls"]

log = logging.getLogger(__name__)


class DuplicateChecks(Protocol):
    """The duplicate marks an eviction suggestion weighs (``transfer.duplicates.DuplicateBook``)."""

    dup_priority: int | None  # the marked pages' priority (policy 'lower'), else None

    async def check(self, src_bs: str | None = None) -> None:
        """Ask the receivers of ``src_bs``'s marks whether they still hold the pages."""
        ...


class IndexCalls:
    """The node's index: ``index`` is the store."""

    def __init__(self, config: Config, index: PrefixIndex, buffers: BufferRegistry) -> None:
        self.config = config
        self.index = index
        self.buffers = buffers
        self.event_subscribers: list[EventSubscriber] = []
        self.republishers: list[EventRepublisher] = []
        buffers.add_hooks(self._index_add, self._index_drop)

    def _index_add(self, bs: BufferSet) -> None:
        lay = bs.layout
        self.index.add_buffer_set(
            bs.buffer_set_id,
            engine_id=bs.engine_id,
            page_size=lay.page_size,
            num_pages=lay.num_pages,
            tp_rank=lay.tp_rank,
            dp_rank=lay.dp_rank,
        )

    def _index_drop(self, bs: BufferSet) -> None:
        try:
            self.index.remove_buffer_set(bs.buffer_set_id)
        except NotFound:  # already dropped by unregister_buffers
            pass

    def hashes(
        self, tokens: np.ndarray | None, hashes: np.ndarray | None, page_size: int, field: str
    ) -> np.ndarray:
        """Chained page hashes of a query given as tokens (canonical scheme) or as hashes."""
        if tokens is None and hashes is None:
            raise InvalidArgument(field, "give tokens or hashes")
        if tokens is not None:
            if page_size <= 0:
                raise InvalidArgument("page_size", "is required (> 0) with token ids")
            return page_hashes(tokens, page_size, self.config.index.hash_seed)
        return as_hashes(hashes, field)  # type: ignore[arg-type]

    def match_prefix(
        self,
        session_id: str | None,
        hashes: np.ndarray,
        page_size: int,
        buffer_set_ids: list[str],
        dp_rank: int | None,
        scores_only: bool,
        lease_ttl_ms: int,
    ) -> tuple[list[Match], Lease | None]:
        if lease_ttl_ms:
            if session_id is None:
                raise Unauthenticated("lease_ttl_ms: a lease needs a session (kvservice-session metadata)")
            if scores_only:
                raise InvalidArgument("lease_ttl_ms", "scores_only matches take no lease")
            if lease_ttl_ms > self.config.index.max_lease_ttl_ms:
                raise InvalidArgument(
                    "lease_ttl_ms", f"exceeds the service maximum {self.config.index.max_lease_ttl_ms}"
                )
        matches = self.index.match(
            hashes,
            page_size=page_size,
            buffer_set_ids=buffer_set_ids or None,
            dp_rank=dp_rank,
            scores_only=scores_only,
        )
        lease = None
        if lease_ttl_ms and any(m.matched_pages for m in matches):
            cap = self.config.limits.max_leases_per_session
            if self.index.lease_count(session_id) >= cap:  # type: ignore[arg-type]
                raise ResourceExhausted(
                    f"max_leases_per_session: this session already holds {cap} live leases; release some"
                )
            lease = self.index.lease(matches, lease_ttl_ms, session_id)  # type: ignore[arg-type]
        return matches, lease

    def publish_pages(
        self,
        session_id: str,
        buffer_set_id: str,
        tokens: np.ndarray | None,
        hashes: np.ndarray | None,
        page_indices: np.ndarray,
        priority: int,
    ) -> int:
        bs = self.buffers.get(buffer_set_id, session_id)
        h = self.hashes(tokens, hashes, bs.layout.page_size, "key")
        return self.index.publish(buffer_set_id, h, page_indices, priority, tokens=tokens)

    async def suggest_evictions(
        self, session_id: str, buffer_set_id: str, max_pages: int, duplicates: DuplicateChecks
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pages to evict first (see ``PrefixIndex.suggest_evictions``). Duplicate marks of the
        buffer set are checked with the receivers first, so a page offered as duplicated was
        held there a moment ago; with policy 'lower' they carry ``duplicate_priority``."""
        self.buffers.get(buffer_set_id, session_id)
        if max_pages <= 0:
            raise InvalidArgument("max_pages", "must be > 0")
        await duplicates.check(buffer_set_id)
        return self.index.suggest_evictions(buffer_set_id, max_pages, duplicates.dup_priority)

    def evict_pages(
        self, session_id: str, buffer_set_id: str, page_indices: np.ndarray, all_pages: bool
    ) -> int:
        self.buffers.get(buffer_set_id, session_id)
        if all_pages:
            if page_indices.size:
                raise InvalidArgument("page_indices", "must be empty with all=true")
            return self.index.evict_all(buffer_set_id)
        return self.index.evict(buffer_set_id, page_indices)

    def warm_up(self) -> None:
        """Compile the index and hashing code paths on scratch data (JIT) so no caller pays it."""
        ix = PrefixIndex()
        ix.add_buffer_set("warm-up", engine_id="", page_size=16, num_pages=64)
        h = page_hashes(np.arange(512, dtype=np.uint32), 16, self.config.index.hash_seed)
        ix.publish("warm-up", h, np.arange(h.size), 0)
        matches = ix.match(h, page_size=16)
        ix.release_lease(ix.lease(matches, 1000, "warm-up").lease_id, "warm-up")
        ix.evict("warm-up", np.arange(4))
        ix.evictable_leaves("warm-up", 4)
        ix.evict_all("warm-up")

    # -- KV events in (presence-only sets) and out (re-published) ------------------------------
    def start_event_streams(self) -> None:
        """Subscribe to the configured vLLM/SGLang KV-event publishers (presence-only sets)."""
        from .events import EventSubscriber, StreamConfig

        for st in self.config.index.event_streams():
            bs_id = f"events-{st['engine_id']}"
            self.index.add_buffer_set(
                bs_id,
                engine_id=st["engine_id"],
                page_size=st["page_size"],
                num_pages=0,
                dp_rank=st.get("dp_rank", 0),
                presence_only=True,
            )
            cfg = StreamConfig(
                endpoint=st["endpoint"],
                buffer_set_id=bs_id,
                page_size=st["page_size"],
                replay_endpoint=st.get("replay_endpoint"),
                topic=st.get("topic", ""),
                scheme=st.get("scheme", "canonical"),
                seed=self.config.index.hash_seed,
            )
            sub = EventSubscriber(self.index, cfg)
            sub.start()
            self.event_subscribers.append(sub)
            log.info("kv events subscribed", extra={"engine_id": st["engine_id"], "endpoint": st["endpoint"]})

    def start_republishers(self) -> None:
        """Re-publish the index as vLLM-format KV events on the configured endpoints."""
        from .events import EventRepublisher, RepublishConfig

        for st in self.config.index.republish_streams():
            pub = EventRepublisher(RepublishConfig(**st))
            self.index.listeners.append(pub)
            self.republishers.append(pub)
            log.info("kv events republished", extra={"endpoints": list(pub.endpoints)})

    def close(self) -> None:
        for sub in self.event_subscribers:
            sub.stop()
        for pub in self.republishers:
            self.index.listeners.remove(pub)
            pub.close()
