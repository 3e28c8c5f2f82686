"""Write-behind filling: pages the index learns (PublishPages, a DONE ExpectDelta's publish, a
claimed landing) are copied from the engine's pool into the tier by one background thread,
within the ``host_tier_fill_gbps`` budget, never on an engine's call::

    index.publish ─▶ Filler.stored (under the index lock: enqueue the hashes, return)
                         │
      fill thread ─▶ index.page_entries (hash -> page, epoch) ─▶ tier.reserve (duplicates skipped)
                 ─▶ _copy.to_tier (one gather per region) ─▶ index.entries_alive ─▶ tier.commit
                 ─▶ sleep what the budget asks

NOTE: a page the engine evicted from the index while the fill read it (its entry's epoch moved)
is not committed: its bytes may be the next sequence's. An engine must evict a page from the
index before it overwrites it -- the index's contract already.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from ..buffers import BufferRegistry
from ..errors import KVServiceError
from ..index.base import BufferSetSpec
from ..index.prefix_index import PrefixIndex
from ._copy import to_tier
from .base import LayoutKey
from .store import HostTier

__all__ = ["Filler"]

log = logging.getLogger(__name__)

MAX_BACKLOG_PAGES = 1 << 20  # past this a publish is not queued (counted in ``dropped_pages``)
BATCH_BYTES = 64 << 20  # one copy at most, so the budget's sleeps stay short


class Filler:
    """An index listener and the thread that drains what it queued."""

    def __init__(self, tier: HostTier, index: PrefixIndex, buffers: BufferRegistry, fill_gbps: float) -> None:
        self.tier = tier
        self.index = index
        self.buffers = buffers
        self.rate = fill_gbps * 1e9  # bytes per second
        self._queue: collections.deque[tuple[str, np.ndarray]] = collections.deque()
        self._cv = threading.Condition()
        self._pages = 0  # hashes queued, not yet taken by the thread (the backlog)
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.dropped_pages = 0
        tier.backlog = lambda: self._pages

    # -- IndexListener ---------------------------------------------------------------------

    def stored(
        self, spec: BufferSetSpec, hashes: np.ndarray, parent: int | None, tokens: np.ndarray | None
    ) -> None:
        if spec.presence_only or not self.tier.enabled or not hashes.size:
            return
        with self._cv:
            if self._stop:
                return
            if self._pages + hashes.size > MAX_BACKLOG_PAGES:
                self.dropped_pages += int(hashes.size)
                return
            self._queue.append((spec.buffer_set_id, hashes.copy()))
            self._pages += int(hashes.size)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvservice-tier-fill", daemon=True)
                self._thread.start()
            self._cv.notify()

    def removed(self, spec: BufferSetSpec, hashes: np.ndarray) -> None:
        """The tier keeps pages the engines evicted: that is what it is for."""

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                bs_id, hashes = self._queue.popleft()
                self._pages = max(0, self._pages - int(hashes.size))
                self._busy = True
            try:
                self._fill(bs_id, hashes)
            except Exception:  # NOTE: a fill is best effort; the thread must outlive any one
                log.exception("host tier fill failed", extra={"buffer_set_id": bs_id})
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _fill(self, bs_id: str, hashes: np.ndarray) -> None:
        try:
            bs = self.buffers.get(bs_id)
            h, pages, slots, epochs = self.index.page_entries(bs_id, hashes)
        except KVServiceError:  # unregistered since: nothing to copy
            return
        if not h.size:
            return
        key, page_bytes = LayoutKey.of(bs.layout), bs.page_bytes
        step = max(1, BATCH_BYTES // page_bytes)
        for lo in range(0, int(h.size), step):
            t0 = time.monotonic()
            res = self.tier.reserve(key, page_bytes, h[lo : lo + step])
            if not res.slots.size:
                continue
            pos = res.positions + lo
            try:
                to_tier(bs, pages[pos], self.tier.slots_view(key), res.slots)
                alive = self.index.entries_alive(bs_id, slots[pos], epochs[pos])
            except BaseException:
                self.tier.abort(res)
                raise
            self.tier.commit(res, alive)
            wait = res.slots.size * page_bytes / self.rate - (time.monotonic() - t0)
            if wait > 0:
                time.sleep(wait)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued is in the tier (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._queue.clear()
            self._pages = 0
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
