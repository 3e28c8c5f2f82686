"""Histogram bucket boundaries shared by every kvservice histogram.

Latencies are in seconds (Prometheus convention) and span 10 µs (a loopback plan step) to
60 s (a transfer that hits a generous deadline); roughly 1-2.5-5 per decade so that
``histogram_quantile`` interpolates within a factor of ~2.5 anywhere in that range.
"""

from __future__ import annotations

__all__ = ["COUNT_BUCKETS", "LATENCY_BUCKETS"]

LATENCY_BUCKETS: tuple[float, ...] = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# Descriptors per transfer: 1 (one packed write) .. 262,144 (per-page descriptors of a long
# sequence over many layers); powers of four.
COUNT_BUCKETS: tuple[float, ...] = tuple(float(4**i) for i in range(10))
