"""Server mechanics: listening addresses, socket mode, health, reflection, grpcurl, shutdown."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from kvservice_client import Client

from tests.support.grpcurl import grpcurl
from tests.support.poll import eventually

ROOT = Path(__file__).resolve().parents[2]


def test_uds_socket_is_private(server) -> None:
    """The Unix socket is created with mode 0600."""
    mode = stat.S_IMODE(os.stat(server.app.uds_path).st_mode)
    assert mode == 0o600


def test_serves_on_uds_and_tcp_port_zero(server) -> None:
    """The same service answers on the UDS and on the TCP port picked for port 0."""
    assert server.app.tcp_port > 0
    for target in (server.address, f"127.0.0.1:{server.app.tcp_port}"):
        with Client(target) as kv:
            assert kv.get_stats().version


def test_health_check_serving(server) -> None:
    """Standard grpc.health.v1 reports SERVING for the server and for KVService."""
    with grpc.insecure_channel(server.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvservice.v1.KVService"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services(server) -> None:
    """Server reflection lists KVService and Health."""
    with grpc.insecure_channel(server.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(stub.ServerReflectionInfo(iter([req]), timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert {"kvservice.v1.KVService", "grpc.health.v1.Health"} <= names


def test_grpcurl_lists_and_calls(server) -> None:
    """grpcurl, a client nobody here wrote, lists the service through reflection and calls GetStats."""
    g = grpcurl()
    target = f"127.0.0.1:{server.app.tcp_port}"
    out = subprocess.run([g, "-plaintext", target, "list"], capture_output=True, text=True, timeout=30)
    assert "kvservice.v1.KVService" in out.stdout, out.stderr
    out = subprocess.run(
        [g, "-plaintext", "-d", "{}", target, "kvservice.v1.KVService/GetStats"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats.get("serviceId", stats.get("service_id")) == server.node.service_id
    out = subprocess.run(
        [g, "-plaintext", "-unix", server.app.uds_path, "grpc.health.v1.Health/Check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert '"SERVING"' in out.stdout, out.stderr


def test_the_node_is_wired_at_build(server) -> None:
    """build_server builds the transfer engine at the peer address its bound ports give, with this
    service's KVPeer servicer for its own calls and the address sessions are told."""
    app = server.app
    assert app.node.transfers.address == app.peer_address
    assert app.node.transfers.peers.me.local is app.peer_servicer
    assert app.servicer.peer_address == app.announced_address


def test_sigterm_drains_and_exits(tmp_path: Path) -> None:
    """`python -m kvservice` exits 0 on SIGTERM after draining and removes its socket."""
    sock = tmp_path / "kv.sock"
    env = {
        **os.environ,
        "KVSERVICE_LOG_FORMAT": "text",
        "KVSERVICE_GRACE_PERIOD_S": "2",
        "KVSERVICE_TRANSFER_INTEGRITY": "1",  # on in tests
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvservice", "--uds-path", str(sock)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def started() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            return sock.exists()

        eventually(started, 60, "the server to start", 0.1)
        with Client(f"unix:{sock}") as kv:
            assert kv.get_stats().version
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
        err = proc.stderr.read() if proc.stderr else ""
        assert rc == 0, err
        assert "draining" in err and "stopped" in err
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_health_cli_exit_codes(server, tmp_path: Path) -> None:
    """`kvservice health` (the Docker/Kubernetes probe) exits 0 on SERVING and 1 when unreachable."""
    ok = subprocess.run(
        [sys.executable, "-m", "kvservice", "health", "--address", server.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvservice",
            "health",
            "--address",
            f"unix:{tmp_path}/none.sock",
            "--timeout",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "unhealthy" in bad.stderr
