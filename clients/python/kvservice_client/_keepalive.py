"""One keepalive and reconnect policy for both ends of every kvservice connection.

gRPC servers answer pings that come more often than they allow with GOAWAY (``too_many_pings``)
after ``max_ping_strikes`` offences; gRPC's server default allows one ping per 5 minutes without
data. A client that pings every 10 s on an idle connection is therefore cut after ~30 s of quiet.
So the two sides' settings are chosen together, here, and both the SDK and the service (engine
UDS, engine TCP, peer listener, peer clients) take theirs from one :class:`KeepalivePolicy`::

    client pings every time_ms ──────────▶ server accepts pings every >= min_recv_ping_interval_ms
    (time_ms >= 2 x min_recv_ping_interval_ms, so jitter never makes a strike)
    server pings every server_time_ms ───▶ client answers (clients never police pings)
    no ack within timeout_ms ────────────▶ that end closes the connection (a dead peer is found in
                                           time_ms + timeout_ms at most; a killed process on the
                                           same host is found at once, its socket closes)

Reconnect backoff is bounded (``max_reconnect_backoff_ms``) so a client resumes its session well
inside the service's session grace period; gRPC's default grows to 120 s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DEFAULT_KEEPALIVE", "KeepalivePolicy"]


@dataclasses.dataclass(frozen=True)
class KeepalivePolicy:
    """Ping and reconnect timing shared by clients and servers (milliseconds)."""

    time_ms: int = 10_000  # client: ping an idle connection this often
    timeout_ms: int = 5_000  # both: no ping ack within this -> the connection is dead
    server_time_ms: int = 10_000  # server: ping an idle client this often (finds dead clients)
    min_recv_ping_interval_ms: int = 5_000  # server: refuse pings closer together than this
    max_ping_strikes: int = 2  # server: too-frequent pings tolerated before GOAWAY
    initial_reconnect_backoff_ms: int = 100
    max_reconnect_backoff_ms: int = 1_000

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0 and f.name != "max_ping_strikes":
                raise ValueError(f"keepalive.{f.name}: must be > 0")
        if self.time_ms < 2 * self.min_recv_ping_interval_ms:
            raise ValueError(
                f"keepalive.time_ms ({self.time_ms}) must be at least twice "
                f"min_recv_ping_interval_ms ({self.min_recv_ping_interval_ms}), or servers cut idle clients"
            )
        if self.initial_reconnect_backoff_ms > self.max_reconnect_backoff_ms:
            raise ValueError("keepalive.initial_reconnect_backoff_ms: must be <= max_reconnect_backoff_ms")

    def client_options(self) -> list[tuple[str, Any]]:
        """gRPC channel arguments for SDK clients and for peer clients between services."""
        return [
            ("grpc.keepalive_time_ms", self.time_ms),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            ("grpc.http2.ping_timeout_ms", self.timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_recv_ping_interval_ms),
            ("grpc.initial_reconnect_backoff_ms", self.initial_reconnect_backoff_ms),
            ("grpc.min_reconnect_backoff_ms", self.initial_reconnect_backoff_ms),
            ("grpc.max_reconnect_backoff_ms", self.max_reconnect_backoff_ms),
        ]

    def server_options(self) -> list[tuple[str, Any]]:
        """gRPC server arguments for every listener of the service."""
        return [
            ("grpc.keepalive_time_ms", self.server_time_ms),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            # NOTE: newer gRPC cores time keepalive pings out with this one (default 1 min).
            ("grpc.http2.ping_timeout_ms", self.timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", self.min_recv_ping_interval_ms),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_recv_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
        ]


DEFAULT_KEEPALIVE = KeepalivePolicy()
