"""Recent transfers: what ended in the last seconds, per role and route, for GetStats.

``RecentTransfers.observe`` is a ``TransferTable.terminal_listeners`` callback (called once per
record, from any thread, must be quick and never raise). It keeps a bounded deque of
(ended, role, route, state, bytes, total_us); ``window`` folds the part younger than the window
into one ``RouteWindow`` per (role, route)::

    ended:   ... 10.2   11.7   13.0 | 14.1   15.5   19.9      now = 20.0, window = 10 s
             dropped at the next    |  └───────── counted ────────┘
             observe (older than MAX_WINDOW_S)

Totals since start are kept apart, so they stay right when samples fall out of the deque.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..transfer.records import Record

__all__ = ["DEFAULT_WINDOW_S", "MAX_WINDOW_S", "RecentTransfers", "RouteWindow"]

log = logging.getLogger(__name__)
DEFAULT_WINDOW_S = 10.0
MAX_WINDOW_S = 300.0
_MAX_SAMPLES = 65_536  # a window of 300 s at ~200 transfers/s; beyond it the oldest go first


@dataclasses.dataclass(frozen=True)
class RouteWindow:
    """Transfers of one ``role`` over one ``route`` that ended within the window."""

    role: str  # "sender" | "receiver"
    route: str  # "fused" | "direct" | "packed" | "auto"
    done: int
    failed: int  # FAILED or ABORTED
    bytes: int
    p50_us: int  # of the DONE ones; 0 with none
    p99_us: int
    done_total: int  # since start
    bytes_total: int


class RecentTransfers:
    """Thread-safe sliding window of finished transfers (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, str, str, bool, int, int]] = collections.deque(
            maxlen=_MAX_SAMPLES
        )
        self._totals: dict[tuple[str, str], list[int]] = {}  # (role, route) -> [done, bytes]
        self.started = clock()

    def observe(self, rec: Record) -> None:
        """Record one terminal ``transfer.records.Record``; never raises."""
        try:
            role, route = str(rec.role).lower(), str(rec.path).lower()
            ok = rec.state == "DONE"
            now = self._clock()
            with self._lock:
                self._samples.append((now, role, route, ok, int(rec.bytes_sent), int(rec.total_us)))
                total = self._totals.setdefault((role, route), [0, 0])
                total[0] += ok
                total[1] += int(rec.bytes_sent)
                while self._samples and self._samples[0][0] < now - MAX_WINDOW_S:
                    self._samples.popleft()
        except Exception:
            log.exception("recording recent transfer failed")

    def window_s(self, window_s: float = DEFAULT_WINDOW_S) -> float:
        """The window actually covered: ``window_s`` clamped to (0, MAX] and to the uptime."""
        want = min(max(window_s, 1e-3), MAX_WINDOW_S)
        return min(want, max(self._clock() - self.started, 1e-3))

    def window(self, window_s: float = DEFAULT_WINDOW_S) -> list[RouteWindow]:
        """One entry per (role, route) seen since start, sorted; counts cover ``window_s``."""
        since = self._clock() - min(max(window_s, 1e-3), MAX_WINDOW_S)
        with self._lock:
            recent = [s for s in self._samples if s[0] >= since]
            totals = {k: tuple(v) for k, v in self._totals.items()}
        out = []
        for (role, route), (done_total, bytes_total) in sorted(totals.items()):
            mine = [s for s in recent if s[1] == role and s[2] == route]
            lat = np.array([s[5] for s in mine if s[3]], dtype=np.float64)
            p50, p99 = np.percentile(lat, [50, 99]) if lat.size else (0.0, 0.0)
            out.append(
                RouteWindow(
                    role,
                    route,
                    done=sum(s[3] for s in mine),
                    failed=sum(not s[3] for s in mine),
                    bytes=sum(s[4] for s in mine),
                    p50_us=int(p50),
                    p99_us=int(p99),
                    done_total=done_total,
                    bytes_total=bytes_total,
                )
            )
        return out
