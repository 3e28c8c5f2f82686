"""Prometheus metrics of a kvservice (prefix ``kvservice_``; seconds and bytes as units).

- transfers, observed when a record ends (``TransferMetrics``): phase and end-to-end latency
  histograms, descriptors per transfer, bytes/pages sent and skipped, skipped bytes, outcomes
  and failures by error code;
- live state, read at scrape time (``NodeCollector``): in-flight transfers, send queue depth
  per peer, staging pools, prefix index size/leases/lookups/hits;
- RPCs (``RpcMetricsInterceptor``): latency per method, outcomes per status code.

``Metrics`` ties them to one registry and serves it over HTTP; see ``docs/design/operations.md``.
"""

from ._buckets import COUNT_BUCKETS, LATENCY_BUCKETS
from ._collector import NodeCollector
from ._http import MetricsHttpServer, metrics_host
from ._metrics import Metrics, metrics_registry
from ._rpc import RpcMetricsInterceptor
from ._transfers import TransferMetrics

__all__ = [
    "COUNT_BUCKETS",
    "LATENCY_BUCKETS",
    "Metrics",
    "MetricsHttpServer",
    "NodeCollector",
    "RpcMetricsInterceptor",
    "TransferMetrics",
    "metrics_host",
    "metrics_registry",
]
