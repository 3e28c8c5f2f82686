"""Building and running the gRPC server.

``build_server(config)`` returns a started-ready ``App`` bound to its addresses (tests bind TCP
port 0 or a temporary UDS and run it in-process); ``serve(config)`` runs one until SIGTERM or
SIGINT, then drains: health turns NOT_SERVING, new transfers are refused, in-flight ones get up
to ``grace_period_s`` to finish, and the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import socket
import stat
import sys
import threading
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvservice_client.contract import TokenFile, message_size_options
from kvservice_client.proto import kvservice_pb2, kvservice_pb2_grpc, peer_pb2, peer_pb2_grpc

from ..buffers import guard as fault_guard
from ..config import Config
from ..errors import InvalidArgument
from ..metrics import Metrics, RpcMetricsInterceptor, metrics_host, metrics_registry
from ..node import Node, NodeParts
from .credentials import bind_credentials, serve_credentials
from .guard import Guard, ListenerPolicy
from .limits import CallLimits
from .listeners import Listeners
from .local_gate import LocalGate
from .peer_servicer import KVPeerServicer
from .servicer import KVServiceServicer
from .tls import server_credentials

if TYPE_CHECKING:
    from ..transfer.lane import RunningLane

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
    servicer: KVServiceServicer
    peer_servicer: KVPeerServicer
    metrics: Metrics
    listeners: Listeners
    credential_socket: socket.socket | None = None  # <uds_path>.cred, bound in build_server
    peer_server: grpc.aio.Server | None = None  # KVPeer's own listener (peer_tcp_address)
    # -- what start() brings up ------------------------------------------------------------
    metrics_port: int = 0  # bound /metrics port once started (0: off)
    credential_server: asyncio.AbstractServer | None = None  # serving <uds_path>.cred (local identity)
    lane: asyncio.Task[RunningLane | None] | None = None  # starting kvservice.transfer.lane
    warmed: threading.Event = dataclasses.field(default_factory=threading.Event)  # warm-up ended

    @property
    def uds_path(self) -> str:
        return self.listeners.uds_path

    @property
    def tcp_port(self) -> int:
        return self.listeners.tcp_port

    @property
    def peer_port(self) -> int:
        return self.listeners.peer_port

    @property
    def address(self) -> str:
        """Address engines should use (the UDS when there is one)."""
        return self.listeners.address

    @property
    def peer_address(self) -> str:
        """Address other kvservices reach this one at (``Listeners.peer_address``)."""
        return self.listeners.peer_address(self.node.config)

    @property
    def announced_address(self) -> str:
        """What sessions are told (``Listeners.announced_address``)."""
        return self.listeners.announced_address(self.node.config)

    def _warm_up(self) -> None:
        try:
            self.node.prefix.warm_up()
        finally:
            self.warmed.set()

    async def start(self) -> None:
        self.node.transfers.start()  # its reaper and duplicate checks run before the first call
        await self.server.start()
        if self.peer_server is not None:
            await self.peer_server.start()
        self.node.prefix.start_republishers()  # before the subscribers, so ingested pages are re-published
        self.node.tier.tier.listeners.extend(self.node.prefix.republishers)  # tier pages: medium CPU
        self.node.prefix.start_event_streams()
        threading.Thread(target=self._warm_up, name="warm-up", daemon=True).start()
        if self.node.config.observability.metrics_port:
            self.metrics_port = self.metrics.serve(
                metrics_host(self.node.config.listen.tcp_address),
                self.node.config.observability.metrics_port,
            )
            log.info("metrics serving", extra={"url": self.metrics.http.url if self.metrics.http else ""})
        if self.uds_path:
            os.chmod(self.uds_path, self.node.config.listen.uds_mode_int)
        if self.credential_socket is not None:
            self.credential_server = await serve_credentials(self.credential_socket, self.node.credentials)
        if self.uds_path and self.node.config.data_plane.lane:  # in the background: a first build takes ~20 s
            from ..transfer import lane

            self.lane = asyncio.get_running_loop().create_task(
                lane.start(
                    self.node.transfers,
                    self.node.sessions,
                    self.uds_path,
                    sorted({self.peer_address, self.address}),
                    self.servicer.lane_call,
                ),
                name="lane",
            )
            self.node.transfers.expect_lane(self.lane)
        _log_exposure(self.node.config)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("kvservice serving", extra={"address": self.address, "peer_address": self.peer_address})

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain (bounded by ``grace_s``, default the config's) and stop."""
        grace = self.node.config.listen.grace_period_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        await self.node.drain(grace)
        if self.lane is not None:
            task, self.lane = self.lane, None
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                running = await task
                if running is not None:
                    running.close(self.node.transfers)
        await self.server.stop(min(grace, 1.0))
        if self.peer_server is not None:
            await self.peer_server.stop(min(grace, 1.0))
        await self.node.close()
        self.metrics.close()
        if self.credential_server is not None:
            self.credential_server.close()
        for path in (self.uds_path, self.uds_path + ".cred"):
            if self.uds_path and os.path.exists(path):
                os.unlink(path)
        log.info("kvservice stopped")


def build_server(config: Config) -> App:
    """Bind the listeners, then build what serves them in dependency order (call ``await
    app.start()`` next)::

        node parts ─▶ guards ─▶ gRPC servers, ports bound ─▶ transfer engine (at the peer address
        the ports give) ─▶ node ─▶ servicers, metrics ─▶ App
    """
    parts = NodeParts.create(config)
    rpc_metrics = RpcMetricsInterceptor(metrics_registry())
    token = TokenFile(config.security.token_file) if config.security.token_file else None
    peer_token = TokenFile(config.security.peer_token_file) if config.security.peer_token_file else None
    # NOTE: metrics outermost, so refused calls are counted by their status too
    limits = CallLimits(config.limits.max_pages_per_call, config.limits.max_tokens_per_call)
    local = LocalGate(
        parts.credentials, parts.sessions, config.security.allowed_uid_set, config.security.peer_uid_set
    )
    guard = Guard(
        ListenerPolicy(True, config.peers_on_engine_tcp, token, peer_token, "tcp_address", limits, local)
    )
    server = _grpc_server(config, rpc_metrics, guard)
    uds_path = config.listen.uds_path
    cred_sock = None
    if uds_path:
        _clear_stale_socket(uds_path)
        cred_sock = bind_credentials(uds_path + ".cred", config.listen.uds_mode_int)
        if not server.add_insecure_port(f"unix:{uds_path}"):
            raise InvalidArgument("uds_path", f"cannot listen on {uds_path}")
    tcp_port = 0
    if config.listen.tcp_address:
        tcp_port = _add_port(
            server,
            "tcp_address",
            config.listen.tcp_address,
            config.security.tls_cert,
            config.security.tls_key,
            config.security.tls_client_ca,
        )
    peer_server, peer_port = None, 0
    if config.listen.peer_tcp_address:
        peer_guard = Guard(ListenerPolicy(False, True, None, peer_token, "peer_tcp_address", limits))
        peer_server = _grpc_server(config, rpc_metrics, peer_guard)
        peer_port = _add_port(
            peer_server,
            "peer_tcp_address",
            config.listen.peer_tcp_address,
            config.security.peer_tls_cert,
            config.security.peer_tls_key,
            config.security.peer_tls_ca,
        )
    listeners = Listeners(uds_path, tcp_port, peer_port)
    # NOTE: the fault guard's SIGBUS handler is installed before the transport starts (built once,
    # cached; before any engine registers memory)
    fault_guard.get()
    node = Node(parts, parts.transfer_engine(listeners.peer_address(config)))
    servicer = KVServiceServicer(node, limits=limits, peer_address=listeners.announced_address(config))
    peer_servicer = KVPeerServicer(node)
    node.transfers.peers.me.local = peer_servicer  # our own KVPeer calls, in-process
    node.transfers.table.terminal_listeners.append(servicer.activity.observe)
    metrics = Metrics(node, interceptor=rpc_metrics)
    metrics.attach(node.transfers)
    health_servicer = health.aio.HealthServicer()
    kvservice_pb2_grpc.add_KVServiceServicer_to_server(servicer, server)
    peer_pb2_grpc.add_KVPeerServicer_to_server(peer_servicer, server)
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
    if peer_server is not None:
        peer_pb2_grpc.add_KVPeerServicer_to_server(peer_servicer, peer_server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, peer_server)
    return App(
        server,
        node,
        health_servicer,
        servicer,
        peer_servicer,
        metrics,
        listeners,
        credential_socket=cred_sock,
        peer_server=peer_server,
    )


def _grpc_server(config: Config, rpc_metrics: RpcMetricsInterceptor, guard: Guard) -> grpc.aio.Server:
    # NOTE: one keepalive policy for every listener (UDS, TCP, peers): kvservice_client.contract.
    return grpc.aio.server(
        interceptors=[rpc_metrics, guard],
        options=message_size_options(config.listen.max_message_mb) + config.listen.keepalive.server_options(),
    )


def _add_port(server: grpc.aio.Server, field: str, address: str, cert: str, key: str, ca: str) -> int:
    """Bind a TCP port, with TLS (and client certificates when ``ca``) if ``cert`` is given."""
    if cert:
        port = server.add_secure_port(address, server_credentials(cert, key, ca))
    else:
        port = server.add_insecure_port(address)
    if not port:
        raise InvalidArgument(field, f"cannot listen on {address}")
    return port


def _log_exposure(cfg: Config) -> None:
    """Say at every start what is open: an insecure listener, an empty peer allowlist."""
    if cfg.security.insecure and (cfg.listen.tcp_address or cfg.listen.peer_tcp_address):
        open_ports = [
            name
            for name, addr, authed in (
                ("tcp_address", cfg.listen.tcp_address, cfg.security.engine_tcp_authenticated),
                ("peer_tcp_address", cfg.listen.peer_tcp_address, cfg.security.peer_tcp_authenticated),
            )
            if addr and not authed
        ]
        if open_ports or (cfg.peers_on_engine_tcp and not cfg.security.peer_token_file):
            log.warning(
                "INSECURE: --insecure is set and %s accept(s) unauthenticated callers; anyone who "
                "reaches the port can use the API",
                ", ".join(open_ports) or "KVPeer on tcp_address",
            )
    if cfg.listen.tcp_address and cfg.security.token_file and not cfg.security.tls_cert:
        log.warning("token_file without tls_cert: bearer tokens cross tcp_address in clear text")
    if cfg.listen.tcp_address and not cfg.peers_on_engine_tcp and not cfg.listen.peer_tcp_address:
        log.info("KVPeer is served on the Unix socket only (set peer_tcp_address for other nodes)")
    if not cfg.security.peer_allowlist:
        log.warning("peer_allowlist is empty: SendDelta may send KV to any address a caller names")


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


def _freeze_after(warmed: threading.Event) -> None:
    if warmed.wait(300):  # the JIT warm-up's objects too
        gc.freeze()


async def serve(config: Config) -> None:
    """Run until SIGTERM/SIGINT, then drain and stop."""
    if config.tuning.gil_switch_us:
        sys.setswitchinterval(config.tuning.gil_switch_us * 1e-6)
    app = build_server(config)
    await app.start()
    # NOTE: the start-up's objects (torch, NIXL, numba's caches: ~350k) never become garbage, yet
    # each full collection walked them all: pauses of 0.1-0.3 s in the middle of transfers on the
    # 2-core VM. Frozen, the cyclic GC scans only what came after.
    gc.freeze()
    asyncio.get_running_loop().run_in_executor(None, _freeze_after, app.warmed)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"kvservice listening on {app.address} (peers: {app.peer_address})", flush=True)
    if app.metrics is not None and app.metrics.http is not None:
        print(f"kvservice metrics on {app.metrics.http.url}", flush=True)
    await stop.wait()
    log.info("signal received; draining", extra={"grace_s": config.listen.grace_period_s})
    await app.stop()
