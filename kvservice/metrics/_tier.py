"""Host-tier series, read at scrape time from the node's tier (``TierStats``, locked)::

    kvservice_tier_capacity_bytes{tier}         bytes the tier may use (host_tier_gb)
    kvservice_tier_used_bytes{tier}             bytes of the pages it holds
    kvservice_tier_pages{tier}                  pages it holds
    kvservice_tier_fill_backlog_pages{tier}     published pages waiting for the write-behind fill
    kvservice_tier_{hit,miss}_pages_total{tier} pages MatchPrefix/LoadPages found / did not find
    kvservice_tier_evicted_pages_total{tier}    pages evicted (LRU, unleased) to make room
    kvservice_tier_stored_{pages,bytes}_total   copied in (fill and OffloadPages)
    kvservice_tier_duplicate_pages_total        skipped: the tier held them already
    kvservice_tier_loaded_pages_total           copied out by LoadPages

``tier`` is "host" (the disk level is not built yet).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ..tier import HostTier

__all__ = ["tier_metrics"]

_GAUGES = (
    ("capacity_bytes", "capacity_bytes", "Bytes the host tier may use (host_tier_gb)."),
    ("used_bytes", "used_bytes", "Bytes of the pages the tier holds."),
    ("pages", "held_pages", "Pages the tier holds."),
    ("fill_backlog_pages", "fill_backlog_pages", "Published pages waiting for the write-behind fill."),
)
_COUNTERS = (
    ("hit_pages", "hits", "Pages MatchPrefix or LoadPages asked for that the tier held."),
    ("miss_pages", "misses", "Pages MatchPrefix or LoadPages asked for that the tier did not hold."),
    ("evicted_pages", "evictions", "Pages evicted (least recently used, unleased) to make room."),
    ("stored_pages", "stored_pages", "Pages copied into the tier (write-behind fill and OffloadPages)."),
    ("stored_bytes", "stored_bytes", "Bytes copied into the tier."),
    ("duplicate_pages", "duplicate_pages", "Pages not copied in because the tier held them already."),
    ("loaded_pages", "loaded_pages", "Pages copied out of the tier into engine pools (LoadPages)."),
)


def tier_metrics(tier: HostTier) -> Iterator[Metric]:
    st = tier.stats()
    for name, field, doc in _GAUGES:
        fam = GaugeMetricFamily(f"kvservice_tier_{name}", doc, labels=("tier",))
        fam.add_metric(("host",), getattr(st, field))
        yield fam
    for name, field, doc in _COUNTERS:
        cfam = CounterMetricFamily(f"kvservice_tier_{name}", doc, labels=("tier",))
        cfam.add_metric(("host",), getattr(st, field))
        yield cfam
