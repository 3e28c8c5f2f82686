"""Landing-pool series, read at scrape time from the transfer engine's landing book.

    kvservice_landing_bytes{location}            bytes landings hold now (arriving or LANDED)
    kvservice_landing_capacity_bytes{location}   the pool's budget (landing_pool_mb)
    kvservice_landing_peak_bytes{location}       the most it ever held
    kvservice_landing_transfers{location}        landings holding bytes now
    kvservice_landing_claims_total{location}     claims done
    kvservice_landing_expired_total{location}    landings ended by their TTL, unclaimed
    kvservice_landing_evicted_total{location}    landings evicted for a newer one (landing_evict=oldest)
    kvservice_landing_refused_total{location}    declarations refused at once: the pool was full

``location`` is "host", "pinned" or "vram:<device>"; a location appears with its first landing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ..transfer.landing import LandingBook

__all__ = ["landing_metrics"]

_GAUGES = (
    ("bytes", "used_bytes", "Bytes landing transfers hold in the landing pool now."),
    ("capacity_bytes", "capacity_bytes", "Landing pool budget (landing_pool_mb)."),
    ("peak_bytes", "peak_bytes", "Most bytes the landing pool ever held."),
    ("transfers", "landings", "Landing transfers holding landing-pool bytes now."),
)
_COUNTERS = (
    ("claims", "claims", "Landed transfers claimed into an engine's pages."),
    ("expired", "expired", "Landed transfers whose TTL passed unclaimed (FAILED, bytes freed)."),
    ("evicted", "evicted", "Landed transfers evicted for a newer landing (FAILED, bytes freed)."),
    ("refused", "refused", "Landing declarations refused at once: the pool could not hold them."),
)


def landing_metrics(landing: LandingBook) -> Iterator[Metric]:
    stats = landing.stats()
    for name, field, doc in _GAUGES:
        fam = GaugeMetricFamily(f"kvservice_landing_{name}", doc, labels=("location",))
        for st in stats:
            fam.add_metric((st.location,), getattr(st, field))
        yield fam
    for name, field, doc in _COUNTERS:
        cfam = CounterMetricFamily(f"kvservice_landing_{name}", doc, labels=("location",))
        for st in stats:
            cfam.add_metric((st.location,), getattr(st, field))
        yield cfam
