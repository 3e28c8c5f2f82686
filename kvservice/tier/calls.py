"""The host tier as the servicers call it: OffloadPages, LoadPages, the tier's part of
MatchPrefix (pages per candidate, the lease's pins) and the write-behind filler. Built by the
node; the filler follows the index as a listener."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers import BufferRegistry, BufferSet
from ..config import Config
from ..errors import InvalidArgument, NotFound, ResourceExhausted
from ..index.base import Lease, Match
from ..index.prefix_index import PrefixIndex, as_hashes
from ..transfer.load import expected_bytes
from ._copy import from_tier, to_tier
from .base import LayoutKey
from .fill import Filler
from .store import HostTier

if TYPE_CHECKING:
    from ..transfer.receiver import Incoming

__all__ = ["Offloaded", "TierCalls"]


class Offloaded:
    """What an OffloadPages stored: ``stored`` new pages, ``already_held`` skipped duplicates,
    ``not_stored`` pages left out because every slot of the arena was pinned or being filled."""

    __slots__ = ("already_held", "not_stored", "stored")

    def __init__(self, stored: int, already_held: int, not_stored: int) -> None:
        self.stored, self.already_held, self.not_stored = stored, already_held, not_stored


def _pages(bs: BufferSet, page_indices: np.ndarray, field: str = "page_indices") -> np.ndarray:
    """Validated int64 page indices of ``bs``: non-empty, in range, distinct."""
    pages = np.asarray(page_indices)
    if pages.ndim != 1 or not pages.size:
        raise InvalidArgument(field, "must name at least one page")
    n = bs.layout.num_pages
    if int(pages.min()) < 0 or int(pages.max()) >= n:
        bad = int(pages[(pages < 0) | (pages >= n)][0])
        raise InvalidArgument(field, f"page index {bad} is outside [0, {n})")
    if np.unique(pages).size != pages.size:
        raise InvalidArgument(field, "duplicate page indices")
    return pages.astype(np.int64)


async def _copy_to_end(fn: Callable[..., None], *args: Any) -> None:
    """Run a copy on a worker thread; a cancelled caller still waits for it to end, because the
    copy owns its reserved or pinned slots until then (freeing them under it would hand them to
    another copy while it still writes or reads them)."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        raise


class TierCalls:
    """``tier`` is the store; ``filler`` its write-behind thread (fed by the index)."""

    def __init__(self, config: Config, index: PrefixIndex, buffers: BufferRegistry) -> None:
        self.config = config
        self.index = index
        self.buffers = buffers
        self.tier = HostTier(config.tier.host_tier_bytes, config.tier.host_tier_layouts)
        self.filler = Filler(self.tier, index, buffers, config.tier.host_tier_fill_gbps)
        if self.tier.enabled:
            index.listeners.append(self.filler)

    def _hashes_for(self, bs: BufferSet, pages: np.ndarray, hashes: np.ndarray | None) -> np.ndarray:
        if hashes is not None and hashes.size:
            h = as_hashes(hashes, "hashes")
            if h.size != pages.size:
                raise InvalidArgument(
                    "hashes", f"must have one hash per page index ({pages.size}), got {h.size}"
                )
            return h
        h, ok = self.index.hashes_at(bs.buffer_set_id, pages)
        if not ok.all():
            i = int(np.argmin(ok))
            raise InvalidArgument(
                "hashes",
                f"page_indices[{i}] (page {int(pages[i])}) holds no indexed page: give the pages' hashes",
            )
        return h

    # -- OffloadPages ----------------------------------------------------------------------

    async def offload_pages(
        self, session_id: str, buffer_set_id: str, page_indices: np.ndarray, hashes: np.ndarray | None
    ) -> Offloaded:
        """Copy the pages into the tier; returns once the engine may overwrite them."""
        bs = self.buffers.get(buffer_set_id, session_id)
        pages = _pages(bs, page_indices)
        h = self._hashes_for(bs, pages, hashes)
        if not self.tier.enabled:
            return Offloaded(0, 0, int(pages.size))
        key = LayoutKey.of(bs.layout)
        res = self.tier.reserve(key, bs.page_bytes, h)
        try:
            await _copy_to_end(to_tier, bs, pages[res.positions], self.tier.slots_view(key), res.slots)
        except BaseException:
            self.tier.abort(res)
            raise
        stored = self.tier.commit(res)
        return Offloaded(stored, res.duplicates, res.no_room)

    # -- LoadPages -------------------------------------------------------------------------

    async def load_pages(
        self, session_id: str, buffer_set_id: str, page_indices: np.ndarray, hashes: np.ndarray
    ) -> int:
        """Copy the tier's pages ``hashes`` into the buffer set's ``page_indices``: all or none."""
        bs = self.buffers.get(buffer_set_id, session_id)
        pages = _pages(bs, page_indices)
        h = as_hashes(hashes, "hashes")
        if h.size != pages.size:
            raise InvalidArgument("hashes", f"must have one hash per page index ({pages.size}), got {h.size}")
        key = LayoutKey.of(bs.layout)
        load = self.tier.begin_load(key, h)
        loaded = False
        try:
            await _copy_to_end(from_tier, bs, pages, self.tier.slots_view(key), load.slots)
            loaded = True
        finally:
            self.tier.end_load(load, loaded)
        return int(pages.size)

    # -- ExpectDelta from_tier -----------------------------------------------------------

    async def source_from_tier(self, inc: Incoming) -> int:
        """Copy the tier's leading run of the declaration's pages past its prefix into their dst
        pages and make them part of the prefix (a ``transfer.receiver.Incoming``, validated and
        not yet declared); returns pages loaded. The last page is left to the senders.

        ::

            sequence   0 .. prefix-1 | prefix .. prefix+n-1 | .. total-1
            from       engine's pool | the tier (this call) | senders
            dst        prefix_idx    | dst[:n]              | dst[n:]
        """
        if inc.landing is not None:
            raise InvalidArgument("from_tier", "is not for a landing transfer (claim it instead)")
        if inc.publish_hashes is None:
            raise InvalidArgument("from_tier", "needs publish_tokens or publish_hashes (the pages' hashes)")
        if not self.tier.enabled or inc.dst_pages.size < 2:
            return 0
        key = LayoutKey.of(inc.bs.layout)
        want = inc.publish_hashes[inc.prefix_pages : inc.prefix_pages + inc.dst_pages.size - 1]
        held = self.tier.held(key, want)
        n = int(np.argmin(held)) if not held.all() else int(held.size)
        if n == 0:
            return 0
        load = self.tier.begin_load(key, want[:n])
        loaded = False
        try:
            await _copy_to_end(from_tier, inc.bs, inc.dst_pages[:n], self.tier.slots_view(key), load.slots)
            loaded = True
        finally:
            self.tier.end_load(load, loaded)
        inc.prefix_page_indices = np.concatenate([inc.prefix_page_indices, inc.dst_pages[:n]])
        inc.dst_pages = inc.dst_pages[n:]
        inc.prefix_pages += n
        inc.rec.expected_bytes = expected_bytes(inc.bs, int(inc.dst_pages.size), inc.aux)
        return n

    # -- MatchPrefix -----------------------------------------------------------------------

    def tier_pages(self, matches: list[Match], hashes: np.ndarray, touch: bool) -> list[int]:
        """Leading pages of the query the tier holds in each candidate's layout."""
        if not self.tier.enabled or not hashes.size:
            return [0] * len(matches)
        out, seen = [], dict[LayoutKey, int]()
        for m in matches:
            try:
                key = LayoutKey.of(self.buffers.get(m.buffer_set_id).layout)
            except NotFound:  # a presence-only (KV-event) set has no pool: no layout
                out.append(0)
                continue
            if key not in seen:
                seen[key] = self.tier.match(key, hashes, touch=touch)
            out.append(seen[key])
        return out

    def lease(self, lease: Lease, matches: list[Match], hashes: np.ndarray) -> int:
        """Pin the tier's leading pages of the query in each candidate's layout with the index's
        lease (released with it); returns pages pinned."""
        keys = set()
        for m in matches:
            try:
                keys.add(LayoutKey.of(self.buffers.get(m.buffer_set_id).layout))
            except NotFound:
                continue
        return sum(
            self.tier.lease(lease.lease_id, lease.owner, lease.expires_unix_ms, k, hashes) for k in keys
        )

    def lease_alone(self, owner: str, ttl_ms: int, matches: list[Match], hashes: np.ndarray) -> Lease | None:
        """A lease of the tier's pages alone, for a MatchPrefix whose candidates hold none of the
        prefix in their pools (the index took no lease); None when the tier holds none either.
        It counts towards ``max_leases_per_session`` like the index's."""
        cap = self.config.limits.max_leases_per_session
        if self.index.lease_count(owner) + self.tier.lease_count(owner) >= cap:
            raise ResourceExhausted(
                f"max_leases_per_session: this session already holds {cap} live leases; release some"
            )
        lease = Lease(uuid.uuid4().hex, owner, int(time.time() * 1000) + ttl_ms, 0)
        pinned = self.lease(lease, matches, hashes)
        return Lease(lease.lease_id, owner, lease.expires_unix_ms, pinned) if pinned else None

    def release_lease(self, lease_id: str, owner: str) -> None:
        """Unpin a MatchPrefix lease in the tier and in the index (a tier-only lease has no index
        part); NotFound / PermissionDenied from the index when neither knew it as ``owner``'s."""
        released = self.tier.release_lease(lease_id, owner)
        try:
            self.index.release_lease(lease_id, owner)
        except NotFound:
            if not released:
                raise

    def close(self) -> None:
        self.filler.close()
        if self.filler in self.index.listeners:
            self.index.listeners.remove(self.filler)
