"""The /metrics HTTP endpoint: prometheus_client's threaded server over one registry."""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["MetricsHttpServer", "metrics_host"]


def metrics_host(tcp_address: str) -> str:
    """Interface the metrics endpoint binds: the gRPC TCP host, else every interface.

    A service confined to loopback (tests, a sidecar behind a proxy) keeps its metrics on
    loopback too; one with only a UDS listens on all interfaces so Prometheus can scrape it.
    """
    if not tcp_address:
        return "0.0.0.0"
    host = tcp_address.rpartition(":")[0].strip("[]")
    return host or "0.0.0.0"


class MetricsHttpServer:
    """Serves ``registry`` on ``host:port`` (port 0: a free one) until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        server, thread = start_http_server(port, addr=host, registry=registry)
        self._server: Any = server
        self._thread: threading.Thread = thread
        self.host = host
        self.port: int = int(server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port; idempotent."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        self._server = None
