"""``Metrics``: everything one kvservice exports, on its own registry.

Lifecycle (driven by ``server.app``)::

    rpc = RpcMetricsInterceptor(metrics_registry())   # build_server: before the gRPC servers
    grpc.aio.server(interceptors=[rpc, ...])
    m = Metrics(node, interceptor=rpc)      # build_server, once the node exists (same registry)
    m.attach(node.transfers)                # every transfer record observed when it ends
    m.serve(host, port)                     # App.start, when config.observability.metrics_port != 0
    m.close()                               # App.stop

One registry per service (not prometheus_client's global one) so several services can run in
one process (tests) without name clashes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest

from .. import VERSION
from ._collector import NodeCollector
from ._http import MetricsHttpServer
from ._rpc import RpcMetricsInterceptor
from ._transfers import TransferMetrics

if TYPE_CHECKING:
    from ..node import Node
    from ..transfer.engine import TransferEngine

__all__ = ["Metrics", "metrics_registry"]


def metrics_registry() -> CollectorRegistry:
    """A registry of its own for one service."""
    # NOTE: process-wide; the ``*_created`` series would double every counter's series and
    # nothing of ours reads them (a restart is visible as a counter reset anyway).
    disable_created_metrics()
    return CollectorRegistry()


class Metrics:
    """Registry, collectors and (optionally) the HTTP endpoint of one service; ``interceptor``:
    the RPC metrics its gRPC servers were built with (a new one on a registry of its own if none)."""

    def __init__(
        self, node: Node, version: str = "", *, interceptor: RpcMetricsInterceptor | None = None
    ) -> None:
        self.interceptor = (
            interceptor if interceptor is not None else RpcMetricsInterceptor(metrics_registry())
        )
        self.registry = self.interceptor.registry
        self._node = node
        self.transfers = TransferMetrics(self.registry, self._page_bytes)
        self.registry.register(NodeCollector(node, version or VERSION))
        self.http: MetricsHttpServer | None = None

    def _page_bytes(self, buffer_set_id: str) -> int:
        try:
            bs = self._node.buffers.get(buffer_set_id)
        except Exception:  # unregistered meanwhile: the bytes saved are unknown, not an error
            return 0
        return int(bs.page_bytes)

    def attach(self, transfers: TransferEngine) -> None:
        """Observe every transfer record of ``transfers`` when it ends."""
        transfers.table.terminal_listeners.append(self.transfers.observe)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics endpoint (port 0 or -1: a free port); returns the bound port."""
        self.http = MetricsHttpServer(self.registry, host, max(port, 0))
        return self.http.port

    def exposition(self) -> bytes:
        """The text a scrape would return now."""
        return generate_latest(self.registry)

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None
