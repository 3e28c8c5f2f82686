"""Gauges read at scrape time from the node's live state (nothing pushes them).

``NodeCollector.collect`` runs on the metrics HTTP thread while the event loop mutates the
node, so it reads only values that are safe to read concurrently: the transfer table (locked),
the sender's queue-depth counter (a copy), staging pool stats and index stats (locked). Any
part that fails is skipped for that scrape and logged; a scrape never raises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._landing import landing_metrics
from ._tier import tier_metrics

if TYPE_CHECKING:
    from ..node import Node
    from ..transfer.load import Load

__all__ = ["NodeCollector"]

log = logging.getLogger(__name__)


class NodeCollector(Collector):
    """Exposes in-flight transfers, send queues, staging pools, the prefix index and build info.

    Before ``App.start`` the transfer gauges read zero (nothing has run).
    """

    def __init__(self, node: Node, version: str) -> None:
        self._node = node
        self._version = version

    def describe(self) -> list[Metric]:
        return []  # no registration-time collect: the node may not be started yet

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "kvservice_build_info",
            "Constant 1, labelled with version and identity.",
            labels=("version", "service_id", "transport"),
        )
        info.add_metric((self._version, str(self._node.service_id), self._node.config.transfer.transport), 1)
        yield info
        for part in (
            self._sessions,
            self._transfers,
            self._engines,
            self._staging,
            self._index,
            self._landing,
            self._tier,
        ):
            try:
                yield from part()
            except Exception:
                log.exception("metrics: reading %s failed", part.__name__.strip("_"))

    def _sessions(self) -> Iterator[Metric]:
        reg = self._node.sessions
        open_ = GaugeMetricFamily("kvservice_sessions", "Open engine sessions by state.", labels=("state",))
        detached = reg.detached_count()
        open_.add_metric(("attached",), len(reg) - detached)
        open_.add_metric(("detached",), detached)
        yield open_
        yield CounterMetricFamily(
            "kvservice_session_resumes", "Session streams resumed after a transport break.", value=reg.resumes
        )
        lost = CounterMetricFamily(
            "kvservice_sessions_lost",
            "Sessions released without a CloseSession (e.g. not resumed within the grace period).",
            labels=("reason",),
        )
        lost.add_metric(("grace_expired",), reg.lost.get("grace_expired", 0))
        for reason, n in sorted(reg.lost.items()):
            if reason != "grace_expired":
                lost.add_metric((reason,), n)
        yield lost
        from ..buffers import guard

        g = guard.get()
        yield CounterMetricFamily(
            "kvservice_engine_memory_faults",
            "Accesses to engine memory that had shrunk under the service (an engine truncated its "
            "shared memory), repaired by the fault guard; each fails the transfers of that buffer set.",
            value=g.faults if g is not None else 0,
        )

    def _transfers(self) -> Iterator[Metric]:
        engine = self._node.transfers
        inflight = GaugeMetricFamily(
            "kvservice_transfers_in_flight", "Transfer sides not yet terminal.", labels=("role",)
        )
        counts = {"sender": 0, "receiver": 0}
        for rec in engine.table.live():
            counts[rec.role.lower()] = counts.get(rec.role.lower(), 0) + 1
        depth = dict(engine.sender.queue_depth)
        for role, n in sorted(counts.items()):
            inflight.add_metric((role,), n)
        yield inflight
        queue = GaugeMetricFamily(
            "kvservice_send_queue_depth",
            "Chunks queued or moving towards one destination service.",
            labels=("peer",),
        )
        for peer, n in sorted(depth.items()):
            queue.add_metric((peer,), max(n, 0))
        yield queue

    def _engines(self) -> Iterator[Metric]:
        """Routing figures per engine (the sum over its buffer sets; latency: the worst rank).
        The label set is bounded by the registered buffer sets: an engine's series go with it."""
        node, engine = self._node, self._node.transfers
        per: dict[str, list[tuple[Load, int]]] = {}
        for bs in node.buffers.all():
            per.setdefault(bs.engine_id or bs.buffer_set_id, []).append(
                (engine.load.load(bs.buffer_set_id), node.index.duplicated_pages(bs.buffer_set_id))
            )
        fams = {
            "in": GaugeMetricFamily(
                "kvservice_engine_inbound_transfers",
                "Inbound transfers declared, unfinished.",
                labels=("engine",),
            ),
            "bytes": GaugeMetricFamily(
                "kvservice_engine_inbound_bytes_pending", "Bytes still to arrive inbound.", labels=("engine",)
            ),
            "out": GaugeMetricFamily(
                "kvservice_engine_outbound_transfers", "Outbound transfers in flight.", labels=("engine",)
            ),
            # NOTE: two gauges, not a "quantile" label: that label is reserved for summaries
            # (promtool check metrics refuses it on a gauge).
            "p50": GaugeMetricFamily(
                "kvservice_engine_inbound_transfer_p50_seconds",
                "Recent inbound transfer time (ExpectDelta to DONE, sliding window), median.",
                labels=("engine",),
            ),
            "p99": GaugeMetricFamily(
                "kvservice_engine_inbound_transfer_p99_seconds",
                "Recent inbound transfer time (ExpectDelta to DONE, sliding window), 99th percentile.",
                labels=("engine",),
            ),
            "budget": GaugeMetricFamily(
                "kvservice_engine_inbound_budget_transfers",
                "Inbound transfer budget of the engine (0: unlimited).",
                labels=("engine",),
            ),
            "dup": GaugeMetricFamily(
                "kvservice_engine_duplicated_pages",
                "Indexed pages another engine also holds (P/D duplicates).",
                labels=("engine",),
            ),
        }
        for name, rows in sorted(per.items()):
            loads = [r[0] for r in rows]
            fams["in"].add_metric((name,), sum(ld.inbound_transfers for ld in loads))
            fams["bytes"].add_metric((name,), sum(ld.inbound_bytes_pending for ld in loads))
            fams["out"].add_metric((name,), sum(ld.outbound_transfers for ld in loads))
            fams["p50"].add_metric((name,), max(ld.inbound_p50_us for ld in loads) / 1e6)
            fams["p99"].add_metric((name,), max(ld.inbound_p99_us for ld in loads) / 1e6)
            fams["budget"].add_metric((name,), sum(ld.budget.max_transfers for ld in loads))
            fams["dup"].add_metric((name,), sum(r[1] for r in rows))
        yield from fams.values()
        refused = CounterMetricFamily(
            "kvservice_admission_refused",
            "ExpectDeltas refused at once because the receiving buffer set was over its inbound budget.",
            labels=("budget",),
        )
        counts = engine.load.refused_total
        for budget in ("inbound_max_transfers", "inbound_max_bytes"):
            refused.add_metric((budget,), counts.get(budget, 0))
        yield refused

    def _staging(self) -> Iterator[Metric]:
        engine = self._node.transfers
        pools = [("host", engine.memory.host_pool.stats())]
        pools += [(f"cuda:{dev}", pool.stats()) for dev, pool in sorted(engine.memory.vram_pools.items())]
        labels = ("pool", "kind")
        fams = {
            "capacity": GaugeMetricFamily(
                "kvservice_staging_capacity_bytes", "Staging pool size.", labels=labels
            ),
            "used": GaugeMetricFamily(
                "kvservice_staging_used_bytes", "Staging bytes held by slots.", labels=labels
            ),
            "slots": GaugeMetricFamily(
                "kvservice_staging_slots_in_use", "Staging slots held.", labels=labels
            ),
            "waiters": GaugeMetricFamily(
                "kvservice_staging_waiters",
                "Reservations waiting for staging space (back-pressure).",
                labels=labels,
            ),
        }
        for name, st in pools:
            key = (name, str(st.kind).lower())
            fams["capacity"].add_metric(key, st.capacity_bytes)
            fams["used"].add_metric(key, st.used_bytes)
            fams["slots"].add_metric(key, st.slots_in_use)
            fams["waiters"].add_metric(key, st.waiters)
        yield from fams.values()

    def _landing(self) -> Iterator[Metric]:
        yield from landing_metrics(self._node.transfers.landing)

    def _tier(self) -> Iterator[Metric]:
        yield from tier_metrics(self._node.tier.tier)

    def _index(self) -> Iterator[Metric]:
        st = self._node.index.stats()
        yield GaugeMetricFamily("kvservice_index_entries", "Pages in the prefix index.", value=st.entries)
        yield GaugeMetricFamily("kvservice_index_leases", "Live MatchPrefix leases.", value=st.leases)
        yield GaugeMetricFamily(
            "kvservice_index_buffer_sets", "Buffer sets the index tracks.", value=st.buffer_sets
        )
        yield GaugeMetricFamily(
            "kvservice_index_memory_bytes", "Host memory the index uses.", value=st.bytes_used
        )
        prio = GaugeMetricFamily(
            "kvservice_index_entries_by_priority", "Index pages per eviction priority.", labels=("priority",)
        )
        for p, n in sorted(st.entries_by_priority.items()):
            prio.add_metric((str(p),), n)
        yield prio
        yield CounterMetricFamily(
            "kvservice_index_lookups", "Prefix lookups (MatchPrefix calls).", value=st.lookups
        )
        yield CounterMetricFamily(
            "kvservice_index_query_pages", "Pages asked about by lookups.", value=st.query_pages
        )
        yield CounterMetricFamily(
            "kvservice_index_hit_pages", "Pages lookups found (longest present prefix).", value=st.hit_pages
        )
