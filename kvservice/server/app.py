"""Building and running the gRPC server.

``build_server(config)`` returns a started-ready ``App`` bound to its addresses (tests bind TCP
port 0 or a temporary UDS and run it in-process); ``serve(config)`` runs one until SIGTERM or
SIGINT, then drains: health turns NOT_SERVING, new transfers are refused, in-flight ones get up
to ``grace_period_s`` to finish, and the server stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import stat
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvservice_client._client import message_size_options
from kvservice_client._proto import kvservice_pb2, kvservice_pb2_grpc, peer_pb2, peer_pb2_grpc

from ..config import Config
from ..errors import InvalidArgument
from ..metrics import Metrics, metrics_host
from ..node import Node
from .credentials import bind_credentials, serve_credentials
from .peer_servicer import KVPeerServicer
from .servicer import KVServiceServicer

__all__ = ["App", "build_server", "serve"]

log = logging.getLogger(__name__)
SERVICE_NAME = kvservice_pb2.DESCRIPTOR.services_by_name["KVService"].full_name
PEER_SERVICE_NAME = peer_pb2.DESCRIPTOR.services_by_name["KVPeer"].full_name


@dataclasses.dataclass
class App:
    """A built server: ``server`` (grpc.aio), the ``node``, and where it listens."""

    server: grpc.aio.Server
    node: Node
    health: health.aio.HealthServicer
    uds_path: str
    tcp_port: int
    metrics: Metrics | None = None
    metrics_port: int = 0  # bound /metrics port once started (0: off)
    peer_servicer: KVPeerServicer | None = None
    servicer: KVServiceServicer | None = None
    credential_socket: socket.socket | None = None  # <uds_path>.cred, bound in build_server
    credential_server: asyncio.AbstractServer | None = None  # serving it (local identity)

    @property
    def address(self) -> str:
        """Address engines should use (the UDS when there is one)."""
        return f"unix:{self.uds_path}" if self.uds_path else f"127.0.0.1:{self.tcp_port}"

    @property
    def peer_address(self) -> str:
        cfg = self.node.config
        if cfg.advertise_address:
            return cfg.advertise_address
        if self.tcp_port:
            host = cfg.tcp_address.rpartition(":")[0]
            return f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '') else host}:{self.tcp_port}"
        return self.address

    async def start(self) -> None:
        from ..transfer.engine import TransferEngine

        await self.server.start()
        self.node.transfers = TransferEngine(self.node, self.peer_address)
        self.node.transfers.peers.me.local = self.peer_servicer
        self.node.transfers.start()
        self.node.start_republishers()  # before the subscribers, so ingested pages are re-published
        self.node.start_event_streams()
        threading.Thread(target=self.node.warm_up, name="warm-up", daemon=True).start()
        if self.metrics is not None:
            self.metrics.attach(self.node.transfers)
            if self.node.config.metrics_port:
                self.metrics_port = self.metrics.serve(
                    metrics_host(self.node.config.tcp_address), self.node.config.metrics_port
                )
                log.info("metrics serving", extra={"url": self.metrics.http.url if self.metrics.http else ""})
        if self.uds_path:
            os.chmod(self.uds_path, self.node.config.uds_mode_int)
        if self.credential_socket is not None:
            self.credential_server = await serve_credentials(self.credential_socket, self.node.credentials)
        if not self.node.config.peer_allowlist:
            log.warning("peer_allowlist is empty: SendDelta may send KV to any address a caller names")
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("kvservice serving", extra={"address": self.address, "peer_address": self.peer_address})

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain (bounded by ``grace_s``, default the config's) and stop."""
        grace = self.node.config.grace_period_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        await self.node.drain(grace)
        await self.server.stop(min(grace, 1.0))
        await self.node.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.credential_server is not None:
            self.credential_server.close()
        for path in (self.uds_path, self.uds_path + ".cred"):
            if self.uds_path and os.path.exists(path):
                os.unlink(path)
        log.info("kvservice stopped")


def build_server(config: Config) -> App:
    """Create the server and bind its ports (call ``await app.start()`` next)."""
    node = Node(config)
    metrics = Metrics(node)
    # NOTE: one keepalive policy for every listener (UDS, TCP, peers); see kvservice_client._keepalive.
    server = grpc.aio.server(
        interceptors=[metrics.interceptor],
        options=message_size_options(config.max_message_mb) + config.keepalive.server_options(),
    )
    servicer = KVServiceServicer(node)
    kvservice_pb2_grpc.add_KVServiceServicer_to_server(servicer, server)
    peer_servicer = KVPeerServicer(node)
    peer_pb2_grpc.add_KVPeerServicer_to_server(peer_servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            PEER_SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    uds_path = config.uds_path
    cred_sock = None
    if uds_path:
        _clear_stale_socket(uds_path)
        cred_sock = bind_credentials(uds_path + ".cred", config.uds_mode_int)
        if not server.add_insecure_port(f"unix:{uds_path}"):
            raise InvalidArgument("uds_path", f"cannot listen on {uds_path}")
    tcp_port = 0
    if config.tcp_address:
        tcp_port = server.add_insecure_port(config.tcp_address)
        if not tcp_port:
            raise InvalidArgument("tcp_address", f"cannot listen on {config.tcp_address}")
    return App(
        server,
        node,
        health_servicer,
        uds_path,
        tcp_port,
        metrics,
        peer_servicer=peer_servicer,
        servicer=servicer,
        credential_socket=cred_sock,
    )


def _clear_stale_socket(path: str) -> None:
    """Remove a socket left by a dead instance; refuse to clobber anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidArgument("uds_path", f"{path} exists and is not a socket")
    os.unlink(path)


async def serve(config: Config) -> None:
    """Run until SIGTERM/SIGINT, then drain and stop."""
    app = build_server(config)
    await app.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"kvservice listening on {app.address} (peers: {app.peer_address})", flush=True)
    if app.metrics is not None and app.metrics.http is not None:
        print(f"kvservice metrics on {app.metrics.http.url}", flush=True)
    await stop.wait()
    log.info("signal received; draining", extra={"grace_s": config.grace_period_s})
    await app.stop()
