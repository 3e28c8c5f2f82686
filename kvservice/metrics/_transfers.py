"""Per-transfer metrics, observed once when a transfer record reaches a terminal state.

``TransferMetrics.observe`` is a ``TransferTable.terminal_listeners`` callback: it is called
exactly once per record (``finish`` is idempotent), from whatever thread finished it, and
must not raise (a metrics bug must never fail a transfer), so it logs and swallows errors.

Labels are bounded: ``role`` (sender/receiver), ``state`` (done/failed/aborted), ``path``
(auto/direct/packed), ``phase`` (queue/plan/pack/wire/unpack), ``error_code`` (a gRPC status
name from the error tree).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from ._buckets import COUNT_BUCKETS, LATENCY_BUCKETS

__all__ = ["PageBytes", "TransferMetrics", "TransferRecord"]

log = logging.getLogger(__name__)

ROLES = ("sender", "receiver")
STATES = ("done", "failed", "aborted")

PageBytes = Callable[[str], int]
"""``page_bytes(buffer_set_id)``: bytes one page occupies across all KV regions of that
buffer set (0 when unknown, e.g. already unregistered)."""


# a record's route note -> the route label ("" and anything else: the gRPC route)
ROUTES = {"lane": "lane", "cross-node lane": "cross_node_lane", "": "grpc"}


class TransferRecord(Protocol):
    """What :meth:`TransferMetrics.observe` reads from a ``transfer.records.Record``."""

    transfer_id: str
    role: str
    buffer_set_id: str
    state: str
    bytes_sent: int
    pages_sent: int
    pages_skipped: int
    descriptors: int
    path: str
    timings_us: dict[str, int]
    error_code: str
    route_note: str

    @property
    def total_us(self) -> int: ...


class TransferMetrics:
    """Histograms and counters about finished transfers, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry, page_bytes: PageBytes | None = None) -> None:
        self._page_bytes = page_bytes
        self.phase_seconds = Histogram(
            "kvservice_transfer_phase_seconds",
            "Time a finished transfer spent in one phase (summed over its chunks); phases that did "
            "not run for it (e.g. pack on the direct path) are not observed.",
            ("role", "phase"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.duration_seconds = Histogram(
            "kvservice_transfer_duration_seconds",
            "End-to-end time of a transfer side, declaration/first chunk to terminal state.",
            ("role", "path", "state"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.descriptors = Histogram(
            "kvservice_transfer_descriptors",
            "Transport descriptors one transfer side posted.",
            ("role", "path"),
            buckets=COUNT_BUCKETS,
            registry=registry,
        )
        self.transfers = Counter(
            "kvservice_transfers",
            "Transfers that reached a terminal state.",
            ("role", "state"),
            registry=registry,
        )
        self.failures = Counter(
            "kvservice_transfer_failures",
            "Transfers that ended FAILED or ABORTED, by error code (the reason).",
            ("role", "error_code"),
            registry=registry,
        )
        self.bytes = Counter(
            "kvservice_transfer_bytes",
            "KV and aux bytes moved by finished transfers.",
            ("role",),
            registry=registry,
        )
        self.pages_sent = Counter(
            "kvservice_transfer_pages_sent",
            "Pages moved by finished transfers.",
            ("role",),
            registry=registry,
        )
        self.pages_skipped = Counter(
            "kvservice_transfer_pages_skipped",
            "Pages not moved because the receiver already held them (prefix reuse).",
            ("role",),
            registry=registry,
        )
        self.skipped_bytes = Counter(
            "kvservice_transfer_skipped_bytes",
            "Bytes not moved thanks to prefix reuse: skipped pages x bytes per page of the buffer set.",
            ("role",),
            registry=registry,
        )
        self.routes = Counter(
            "kvservice_transfers_by_route",
            "Finished transfer sides by the route that moved their bytes: lane (the native same-node "
            "lane), cross_node_lane (the native cross-node lane) or grpc (the gRPC route).",
            ("role", "route"),
            registry=registry,
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        for role in ROLES:  # so rate() has a series (at 0) before the first transfer ends
            for state in STATES:
                self.transfers.labels(role, state)
            for route in ROUTES.values():
                self.routes.labels(role, route)
            for c in (self.bytes, self.pages_sent, self.pages_skipped, self.skipped_bytes):
                c.labels(role)

    def observe(self, rec: TransferRecord) -> None:
        """Record one terminal transfer record; never raises."""
        try:
            self._observe(rec)
        except Exception:
            log.exception("recording transfer metrics failed", extra={"transfer_id": rec.transfer_id})

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once (labels() costs a lock and a tuple per call;
        this runs for every transfer side; label sets here are never removed)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _observe(self, rec: TransferRecord) -> None:
        role, state, path = rec.role.lower(), rec.state.lower(), rec.path.lower()
        c = self._child
        for phase, us in rec.timings_us.items():
            if us > 0:
                c(self.phase_seconds, role, phase).observe(us / 1e6)
        c(self.duration_seconds, role, path, state).observe(rec.total_us / 1e6)
        if rec.descriptors:
            c(self.descriptors, role, path).observe(rec.descriptors)
        c(self.transfers, role, state).inc()
        # (the native same-node lane's sides: their engines read their END on the lane)
        note = getattr(rec, "route_note", "") or ("lane" if getattr(rec, "lane_told", False) else "")
        c(self.routes, role, ROUTES.get(note, "grpc")).inc()
        if state != "done":
            c(self.failures, role, rec.error_code or "UNKNOWN").inc()
        c(self.bytes, role).inc(rec.bytes_sent)
        c(self.pages_sent, role).inc(rec.pages_sent)
        if rec.pages_skipped:
            c(self.pages_skipped, role).inc(rec.pages_skipped)
            per_page = self._page_bytes(rec.buffer_set_id) if self._page_bytes else 0
            c(self.skipped_bytes, role).inc(rec.pages_skipped * per_page)
