"""Transfer load per buffer set, and inbound budgets (DESIGN "Routing support").

Routers ask MatchPrefix who holds a prefix; the answer also says who can take a transfer now.
For each buffer set (one engine rank) :class:`LoadBook` reports:

* inbound transfers declared and unfinished, and the bytes still to arrive over them;
* outbound transfers in flight; staging reservations waiting in the pool it uses;
* the inbound transfer time (ExpectDelta to DONE) over a sliding window, p50 and p99;
* its inbound budget, and how many ExpectDeltas that budget refused.

Budget: at most ``max_transfers`` unfinished inbound transfers and ``max_bytes`` bytes still
to arrive (0: unlimited). An ExpectDelta that would exceed either is refused at once with
RESOURCE_EXHAUSTED naming the budget and the use, never queued into a timeout: seed 002 found
that requests fail on the decode side's transfer queue, so a router is better served by an
immediate "no" and plain P/D. A single transfer larger than ``max_bytes`` is admitted when
nothing else is inbound, so no transfer is refused forever.

Figures are computed from the live transfer records of the buffer set (bounded by the budget),
so they always equal what Poll / GetStats report; the latency window is kept per buffer set,
percentiles cached until it changes.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np

from ..buffers import BufferSet
from ..errors import ResourceExhausted
from .records import Record, TransferTable

__all__ = ["Budget", "Load", "LoadBook", "expected_bytes"]

WINDOW_S = 60.0
WINDOW_SAMPLES = 512


@dataclasses.dataclass(frozen=True)
class Budget:
    """Inbound limits of one buffer set; 0 means unlimited."""

    max_transfers: int = 0
    max_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Load:
    inbound_transfers: int
    inbound_bytes_pending: int
    outbound_transfers: int
    staging_waiters: int
    inbound_p50_us: int
    inbound_p99_us: int
    inbound_samples: int
    budget: Budget
    inbound_refused: int
    landed_transfers: int = 0  # LANDED in the landing pool, waiting for a Claim (not inbound)
    landed_bytes: int = 0

    @property
    def admits(self) -> bool:
        """Whether an ExpectDelta now would be admitted (unless it alone exceeds the bytes left)."""
        b = self.budget
        return (not b.max_transfers or self.inbound_transfers < b.max_transfers) and (
            not b.max_bytes or self.inbound_bytes_pending < b.max_bytes
        )


EMPTY_LOAD = Load(0, 0, 0, 0, 0, 0, 0, Budget(), 0)


def expected_bytes(bs: BufferSet, delta_pages: int, aux_rows: dict[str, np.ndarray]) -> int:
    """KV and aux bytes a receiver rank waits for: its page bytes times the delta pages (every
    sender's head slices add up to its local heads), plus the declared aux rows (validated)."""
    row_bytes = {a.name: a.row_bytes for a in bs.aux}
    return bs.page_bytes * delta_pages + sum(row_bytes[n] * int(rows.size) for n, rows in aux_rows.items())


class _Window:
    """Recent inbound DONE times of one buffer set; percentiles cached until a change."""

    def __init__(self) -> None:
        self.samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=WINDOW_SAMPLES)
        self._cached: tuple[int, int, int] | None = None

    def add(self, now: float, us: int) -> None:
        self.samples.append((now, us))
        self._cached = None

    def quantiles(self, now: float) -> tuple[int, int, int]:
        while self.samples and self.samples[0][0] < now - WINDOW_S:
            self.samples.popleft()
            self._cached = None
        if self._cached is None:
            if not self.samples:
                self._cached = (0, 0, 0)
            else:
                us = np.fromiter((s[1] for s in self.samples), np.int64, len(self.samples))
                p50, p99 = np.percentile(us, [50, 99])
                self._cached = (int(p50), int(p99), int(us.size))
        return self._cached


class LoadBook:
    """Load figures and budgets of every buffer set of this service. Thread-safe (metrics scrape
    from their own thread); admission runs on the event loop."""

    def __init__(
        self, table: TransferTable, default: Budget, waiters_of: Callable[[str], int] = lambda _: 0
    ) -> None:
        self._table = table
        self._default = default
        self._waiters_of = waiters_of
        self._lock = threading.Lock()
        self._budgets: dict[str, Budget] = {}
        self._windows: dict[str, _Window] = {}
        self._refused: collections.Counter[str] = collections.Counter()
        self.refused_total: collections.Counter[str] = collections.Counter()  # by budget name
        table.terminal_listeners.append(self._ended)

    def set_budget(self, buffer_set_id: str, max_transfers: int, max_bytes: int) -> Budget:
        """The buffer set's budget: its own values where given (> 0), else the service default."""
        b = Budget(max_transfers or self._default.max_transfers, max_bytes or self._default.max_bytes)
        with self._lock:
            self._budgets[buffer_set_id] = b
        return b

    def drop(self, buffer_set_id: str) -> None:
        with self._lock:
            self._budgets.pop(buffer_set_id, None)
            self._windows.pop(buffer_set_id, None)
            self._refused.pop(buffer_set_id, None)

    def _ended(self, rec: Record) -> None:
        if rec.role != "RECEIVER" or rec.state != "DONE" or rec.landing:  # a claim's wait is no transfer time
            return
        with self._lock:
            if rec.buffer_set_id in self._budgets:
                self._windows.setdefault(rec.buffer_set_id, _Window()).add(rec.ended, rec.total_us)

    def _live(self, buffer_set_id: str) -> tuple[int, int, int]:
        """(inbound transfers, inbound bytes still to arrive, outbound transfers) now."""
        inbound, pending, outbound, _, _ = self._live_landed(buffer_set_id)
        return inbound, pending, outbound

    def _live_landed(self, buffer_set_id: str) -> tuple[int, int, int, int, int]:
        """``_live``'s figures and the LANDED transfers and their bytes (not inbound any more)."""
        inbound = outbound = pending = landed = landed_bytes = 0
        for rec in self._table.live_of(buffer_set_id):
            if rec.state == "LANDED":
                landed += 1
                landed_bytes += rec.expected_bytes
            elif rec.role == "RECEIVER":
                inbound += 1
                pending += max(rec.expected_bytes - rec.bytes_sent, 0)
            else:
                outbound += 1
        return inbound, pending, outbound, landed, landed_bytes

    def load(self, buffer_set_id: str) -> Load:
        inbound, pending, outbound, landed, landed_bytes = self._live_landed(buffer_set_id)
        now = time.monotonic()
        with self._lock:
            budget = self._budgets.get(buffer_set_id, self._default)
            window = self._windows.get(buffer_set_id)
            p50, p99, n = window.quantiles(now) if window is not None else (0, 0, 0)
            refused = self._refused.get(buffer_set_id, 0)
        return Load(
            inbound,
            pending,
            outbound,
            self._waiters_of(buffer_set_id),
            p50,
            p99,
            n,
            budget,
            refused,
            landed,
            landed_bytes,
        )

    def admit(self, buffer_set_id: str, nbytes: int) -> None:
        """RESOURCE_EXHAUSTED, naming the budget and its use, if a new inbound transfer of
        ``nbytes`` would exceed the buffer set's budget. Call on the event loop right before the
        record is added (no await in between), so check and add are one step."""
        with self._lock:
            budget = self._budgets.get(buffer_set_id, self._default)
        if not budget.max_transfers and not budget.max_bytes:
            return
        inbound, pending, _ = self._live(buffer_set_id)
        why = ""
        if budget.max_transfers and inbound >= budget.max_transfers:
            name = "inbound_max_transfers"
            why = (
                f"inbound_max_transfers: buffer set {buffer_set_id} has {inbound} unfinished inbound "
                f"transfers, its budget is {budget.max_transfers}"
            )
        elif budget.max_bytes and inbound and pending + nbytes > budget.max_bytes:
            name = "inbound_max_bytes"
            why = (
                f"inbound_max_bytes: buffer set {buffer_set_id} has {pending} bytes still to arrive; "
                f"{nbytes} more would exceed its budget of {budget.max_bytes}"
            )
        if why:
            with self._lock:
                self._refused[buffer_set_id] += 1
                self.refused_total[name] += 1
            raise ResourceExhausted(why + " (fall back to another decode engine or plain P/D)")
