"""The landing book: landing declarations, LANDED, expiry, eviction, and what routers may see.

One :class:`Entry` per landing receiver rank, keyed like its declaration (transfer id, buffer set)::

    ExpectDelta(landing)  reserve bytes in the pool, pages and aux rows (RESOURCE_EXHAUSTED at once
         │                when they do not fit), declare into the landing view (the usual receive path)
         ▼
    PENDING → TRANSFERRING → LANDED ── Claim ──▶ DONE            bytes freed
                               │ ├── TTL ──────▶ FAILED  DEADLINE_EXCEEDED "landing expired"
                               │ ├── evicted ──▶ FAILED  RESOURCE_EXHAUSTED "landing evicted"
                               │ └── Abort, owner gone ─▶ ABORTED
    (before LANDED: the transfer's own deadline, aborts and failures, as for any receiver)

NOTE: every terminal state frees the bytes (``_ended``, once no copy into them runs), so no path
leaks them, and none frees them silently: the record ends with a reason its session is told of.
Event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np

from ...errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from ..receiver import Incoming
from ..records import Record
from .pool import Landing, LandingPool, LandingStats

if TYPE_CHECKING:
    from ..engine import TransferEngine

__all__ = ["Entry", "LandingBook", "LandedMatch"]

BACKSTOP_S = 1.0  # the reaper ends a LANDED record this long after its TTL if the timer did not


@dataclasses.dataclass(frozen=True)
class LandedMatch:
    """Leading query pages a buffer set can have by claiming ``transfer_id`` (0: none)."""

    pages: int = 0
    transfer_id: str = ""


@dataclasses.dataclass(eq=False)
class Entry:
    inc: Incoming
    mem: Landing
    ttl_s: float
    book: LandingBook
    landed_at: float = 0.0
    timer: asyncio.TimerHandle | None = None
    settled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # LANDED or ended
    claiming: bool = False
    loop: asyncio.AbstractEventLoop = dataclasses.field(default_factory=asyncio.get_running_loop)

    @property
    def pages(self) -> int:
        return int(self.inc.dst_pages.size)

    def landed(self, inc: Incoming) -> None:
        """The receiver got every byte (Receiver.complete_if_done)."""
        self.book.landed(self)


class LandingBook:
    def __init__(self, engine: TransferEngine) -> None:
        cfg = engine.config
        self.e = engine
        self.pool = LandingPool(cfg.transfer.landing_pool_mb << 20, register=engine.memory.reg_pool)
        self.default_ttl_ms = cfg.transfer.landing_ttl_ms
        self.max_ttl_ms = cfg.transfer.landing_max_ttl_ms
        self.evict_policy = cfg.transfer.landing_evict
        self.entries: dict[tuple[str, str], Entry] = {}
        self._by_bs: dict[str, dict[str, Entry]] = {}
        self.counts: dict[str, dict[str, int]] = {}  # arena kind -> claims/expired/evicted/refused
        self.claim_us: list[int] = []  # recent claims' service time (bench, metrics)
        engine.table.terminal_listeners.append(self._ended)

    def count(self, kind: str, what: str) -> None:
        c = self.counts.setdefault(kind, dict.fromkeys(("claims", "expired", "evicted", "refused"), 0))
        c[what] += 1

    # -- declare ---------------------------------------------------------------------------
    async def expect(self, inc: Incoming, ttl_ms: int, sender_address: str = "") -> Record:
        """Reserve the landing bytes (or refuse at once), then declare ``inc`` into them."""
        if ttl_ms > self.max_ttl_ms:
            raise InvalidArgument("landing.ttl_ms", f"{ttl_ms} exceeds the service maximum {self.max_ttl_ms}")
        key = (inc.rec.transfer_id, inc.bs.buffer_set_id)
        old = self.entries.get(key)
        if old is not None and not old.inc.rec.terminal:
            raise AlreadyExists(f"transfer_id: {key[0]!r} is already declared for buffer set {key[1]!r}")
        mem = self._reserve(inc)
        entry = Entry(inc, mem, (ttl_ms or self.default_ttl_ms) / 1000, self)
        inc.bs, inc.regions, inc.landing = mem.bs, mem.regions, entry
        inc.rec.landing = True
        self._put(key, entry)
        try:
            return await self.e.expect(inc, sender_address)
        except BaseException:
            self._drop(key, entry)
            self.pool.give(mem)
            raise

    def _reserve(self, inc: Incoming) -> Landing:
        bs, pages = inc.bs, int(inc.dst_pages.size)
        needs = self.pool.needs(bs, pages, inc.aux)
        got = self.pool.take(bs, pages, inc.aux, needs)
        if got is None and self.evict_policy == "oldest":
            held = {arena for arena, _ in needs}
            victims = sorted(
                (
                    e
                    for e in self.entries.values()
                    if any(p.arena in held for p in e.mem.parts)
                    and e.inc.rec.state == "LANDED"
                    and not e.claiming
                    and not e.inc.busy
                ),
                key=lambda e: e.landed_at,
            )
            k = self.pool.victims_needed(needs, [v.mem for v in victims])
            for v in victims[: max(k, 0)]:  # NOTE: only when evicting makes it fit
                self._evict(v)
            got = self.pool.take(bs, pages, inc.aux, needs) if k > 0 else None
        if got is None:
            arena, need = self.pool.short_of(needs)
            self.count(arena.kind, "refused")
            rows = sum(int(r.size) for r in inc.aux.values())
            what = f"{pages} pages" + (f" and {rows} aux rows" if rows else "")
            why = (
                f"it alone exceeds the pool of {arena.capacity} bytes"
                if need > arena.capacity
                else f"the pool holds {arena.used_bytes} of {arena.capacity} bytes in "
                f"{self.pool.landings.get(arena.kind, 0)} landings"
            )
            raise ResourceExhausted(
                f"landing_pool_mb: a landing of {what} needs {need} bytes of the {arena.kind} landing "
                f"pool; {why} (claim or abort landed transfers, or wait for the decode engine's allocation)"
            )
        return got

    def _evict(self, v: Entry) -> None:
        age_ms = int((time.monotonic() - v.landed_at) * 1000)
        self.count(v.mem.arena.kind, "evicted")
        self.e.table.finish(
            v.inc.rec,
            "FAILED",
            "RESOURCE_EXHAUSTED",
            f"landing evicted: transfer {v.inc.rec.transfer_id!r} had {v.pages} landed pages unclaimed for "
            f"{age_ms} ms; they were freed for a newer landing (landing pool full, landing_evict=oldest)",
        )
        self.release(v)

    # -- LANDED, expiry, release -------------------------------------------------------------
    def landed(self, entry: Entry) -> None:
        rec = entry.inc.rec
        if rec.terminal or rec.state == "LANDED":
            return
        now = time.monotonic()
        entry.landed_at = now
        self.e.table.update(rec, state="LANDED", deadline=now + entry.ttl_s + BACKSTOP_S)
        entry.timer = asyncio.get_running_loop().call_later(entry.ttl_s, self._expire_soon, entry)
        entry.settled.set()

    def _expire_soon(self, entry: Entry) -> None:
        if not entry.claiming and not entry.inc.rec.terminal:
            asyncio.ensure_future(self._expire(entry))

    async def _expire(self, entry: Entry) -> None:
        if entry.claiming or entry.inc.rec.terminal:  # NOTE: a claim that began since the timer wins
            return
        self.count(entry.mem.arena.kind, "expired")
        ttl_ms = int(entry.ttl_s * 1000)
        await self.e.fail_incoming(
            entry.inc,
            DeadlineExceeded(
                f"landing expired: transfer {entry.inc.rec.transfer_id!r} landed {entry.pages} pages and was "
                f"not claimed within its landing TTL of {ttl_ms} ms; the pages were freed"
            ),
        )

    def _ended(self, rec: Record) -> None:
        if not rec.landing:
            return
        key = (rec.transfer_id, rec.buffer_set_id)
        entry = self.entries.get(key)
        if entry is None or entry.inc.rec is not rec:
            return
        self.release(entry)

    def release(self, entry: Entry) -> None:
        """Free a landing whose record ended (idempotent). The table tells ``_ended`` a loop turn
        after the end; eviction and claims call this at once so the bytes are free on return."""
        key = (entry.inc.rec.transfer_id, entry.inc.rec.buffer_set_id)
        if entry.timer is not None:
            entry.timer.cancel()
        entry.settled.set()
        if entry.inc.busy:  # a write or claim copy into the bytes finishes first
            loop = entry.loop
            loop.call_soon_threadsafe(lambda: loop.create_task(self._free_when_idle(key, entry)))
        else:
            self._free(key, entry)

    async def _free_when_idle(self, key: tuple[str, str], entry: Entry) -> None:
        await entry.inc.quiet()
        self._free(key, entry)

    def _free(self, key: tuple[str, str], entry: Entry) -> None:
        self.pool.give(entry.mem)
        self._drop(key, entry)

    def _put(self, key: tuple[str, str], entry: Entry) -> None:
        self.entries[key] = entry
        self._by_bs.setdefault(key[1], {})[key[0]] = entry

    def _drop(self, key: tuple[str, str], entry: Entry) -> None:
        if self.entries.get(key) is entry:
            del self.entries[key]
            per = self._by_bs.get(key[1], {})
            per.pop(key[0], None)
            if not per:
                self._by_bs.pop(key[1], None)

    # -- lookups -----------------------------------------------------------------------------
    def find(self, transfer_id: str, buffer_set_id: str) -> Entry:
        """The live landing of ``transfer_id`` into ``buffer_set_id``, or an error saying what became
        of it (FAILED_PRECONDITION when it ended or is no landing, NOT_FOUND when unknown)."""
        entry = self.entries.get((transfer_id, buffer_set_id))
        if entry is not None and not entry.inc.rec.terminal:
            return entry
        rec = self.e.table.get((transfer_id, "RECEIVER", buffer_set_id))
        if rec is None:
            raise NotFound(
                f"transfer_id: no landing transfer {transfer_id!r} for buffer set {buffer_set_id!r}"
            )
        if not rec.landing:
            raise FailedPrecondition(
                f"transfer_id: {transfer_id!r} was declared with destination pages, not as a landing; "
                "there is nothing to claim"
            )
        raise FailedPrecondition(
            f"transfer_id: {transfer_id!r} cannot be claimed: its landed pages are gone, it ended "
            f"{rec.state} ({rec.error_code}: {rec.error})"
        )

    def match(self, hashes: np.ndarray, buffer_set_id: str) -> LandedMatch:
        """The LANDED transfer of ``buffer_set_id`` covering most leading pages of ``hashes`` past
        its own prefix (one vectorised comparison per landed transfer of the buffer set)."""
        best = LandedMatch()
        for tid, e in self._by_bs.get(buffer_set_id, {}).items():
            h = e.inc.publish_hashes
            if h is None or e.inc.rec.state != "LANDED":
                continue
            m = min(h.size, hashes.size)
            diff = np.flatnonzero(h[:m] != hashes[:m])
            k = int(diff[0]) if diff.size else m
            if k > e.inc.prefix_pages and k > best.pages:
                best = LandedMatch(k, tid)
        return best

    def stats(self) -> list[LandingStats]:
        return self.pool.stats(self.counts)
