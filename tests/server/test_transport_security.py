"""Who may call over TCP: start-up refusal without --insecure, bearer tokens (re-read on
change), mutual TLS (certificates re-read on rotation), and the peer-only listener."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvservice_client import ChannelSecurity, Client, Unauthenticated, Unavailable
from kvservice_client._proto import kvservice_pb2 as pb
from kvservice_client._proto import kvservice_pb2_grpc, peer_pb2, peer_pb2_grpc

from kvservice.cli import main as cli_main
from kvservice.config import ConfigError, load_config
from tests.support.pki import CA
from tests.support.poll import eventually

RESTAT_WAIT_S = 1.2  # the token file is re-stat'ed at most once a second


def _tcp(server: Any, peer: bool = False) -> str:
    return f"127.0.0.1:{server.app.peer_port if peer else server.app.tcp_port}"


def _stats_code(target: str, metadata: Any = None, creds: Any = None) -> grpc.StatusCode:
    ch = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
    with ch:
        try:
            kvservice_pb2_grpc.KVServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _write(path: str, text: str) -> None:
    tmp = path + ".new"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # a new inode, as a Kubernetes secret update swaps it


@pytest.mark.parametrize("field", ["tcp_address", "peer_tcp_address"])
def test_a_tcp_listener_that_authenticates_nobody_is_refused_at_start(field: str, capsys: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config({field: "127.0.0.1:0"}, environ={})
    assert load_config({field: "127.0.0.1:0", "insecure": True}, environ={}).security.insecure
    flag = "--" + field.replace("_", "-")
    assert cli_main(["serve", flag, "127.0.0.1:0", "--uds-path", "/tmp/kvs-refused.sock"]) == 2
    assert field in capsys.readouterr().err
    with pytest.raises(ConfigError, match="tls_key"):
        load_config({"tls_cert": "/etc/hostname"}, environ={})
    with pytest.raises(ConfigError, match="token_file"):
        load_config({"tcp_address": "127.0.0.1:0", "token_file": "/nonexistent/token"}, environ={})


def test_insecure_is_an_explicit_flag_and_is_logged_at_every_start(make_server: Any, caplog: Any) -> None:
    from kvservice.config import parse_args

    assert parse_args(["--insecure", "--tcp-address", "127.0.0.1:0"]).security.insecure
    assert not parse_args(["--insecure", "false"]).security.insecure
    with caplog.at_level(logging.WARNING, logger="kvservice.server.app"):
        make_server(insecure=True)
    assert any("INSECURE" in r.getMessage() for r in caplog.records)


def test_bearer_tokens_over_tcp_and_their_rotation(make_server: Any, tmp_path: Any) -> None:
    token = str(tmp_path / "token")
    _write(token, "old-token\n")
    s = make_server(insecure=False, token_file=token)
    target = _tcp(s)
    assert _stats_code(target) == grpc.StatusCode.UNAUTHENTICATED
    assert _stats_code(target, [("authorization", "Bearer wrong")]) == grpc.StatusCode.UNAUTHENTICATED
    assert _stats_code(target, [("authorization", "Basic old-token")]) == grpc.StatusCode.UNAUTHENTICATED
    assert _stats_code(target, [("authorization", "Bearer old-token")]) == grpc.StatusCode.OK
    with grpc.insecure_channel(target) as ch:  # probes carry no credentials
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        with pytest.raises(grpc.RpcError) as info:  # peers are not served on a secured engine port
            peer_pb2_grpc.KVPeerStub(ch).Handshake(peer_pb2.HandshakeRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with Client(target, security=ChannelSecurity(token_file=token), timeout=5) as kv:
        assert kv.get_stats().service_id
        _write(token, "new-token\nold-token\n")  # rotation with overlap
        time.sleep(RESTAT_WAIT_S)
        assert _stats_code(target, [("authorization", "Bearer new-token")]) == grpc.StatusCode.OK
        _write(token, "new-token\n")
        time.sleep(RESTAT_WAIT_S)
        assert _stats_code(target, [("authorization", "Bearer old-token")]) == grpc.StatusCode.UNAUTHENTICATED
        assert kv.get_stats().service_id  # the SDK re-read the file too
    os.unlink(token)
    time.sleep(RESTAT_WAIT_S)
    assert _stats_code(target, [("authorization", "Bearer new-token")]) == grpc.StatusCode.UNAUTHENTICATED
    with Client(s.address, timeout=5) as local:  # the Unix socket needs no token
        assert local.get_stats().service_id
    with pytest.raises(Unauthenticated, match="authorization"):
        Client(target, timeout=5).get_stats()

    # NOTE: the server accounts a call just after the client got its status: wait for the last one.
    # The SDK's get_stats opens its session first, so its refusal is counted on OpenSession.
    def refused() -> float:
        return sum(
            s.app.metrics.registry.get_sample_value(
                "kvservice_rpc_handled_total",
                {"service": "KVService", "method": method, "code": "UNAUTHENTICATED"},
            )
            or 0
            for method in ("GetStats", "OpenSession")
        )

    eventually(
        lambda: refused() >= 6,
        timeout=5,
        what=lambda: f"{refused()} refusals counted, 6 wanted",
        interval=0.05,
    )


def test_mutual_tls_requires_a_client_certificate_of_the_ca_and_follows_rotation(
    make_server: Any, tmp_path: Any
) -> None:
    ca, other = CA(str(tmp_path), "ca-one"), CA(str(tmp_path), "ca-two")
    srv, good, bad = ca.leaf("kvservice"), ca.leaf("engine"), other.leaf("intruder")
    cert, key, client_ca = (str(tmp_path / n) for n in ("server.crt", "server.key", "clients.crt"))
    for src, dst in ((srv.cert, cert), (srv.key, key), (ca.cert, client_ca)):
        _write(dst, open(src).read())
    s = make_server(insecure=False, tls_cert=cert, tls_key=key, tls_client_ca=client_ca)
    target = _tcp(s)
    engine = ChannelSecurity(ca_file=ca.cert, cert_file=good.cert, key_file=good.key)
    with Client(target, security=engine, timeout=5) as kv:
        assert kv.get_stats().service_id
    for sec in (
        ChannelSecurity(ca_file=ca.cert),  # no client certificate
        ChannelSecurity(ca_file=ca.cert, cert_file=bad.cert, key_file=bad.key),  # another CA's
    ):
        with pytest.raises(Unavailable):
            Client(target, security=sec, timeout=2).get_stats()
    assert _stats_code(target) == grpc.StatusCode.UNAVAILABLE  # plain text: no handshake
    # rotation: the service now trusts ca-two and presents a ca-two certificate
    srv2, good2 = other.leaf("kvservice"), other.leaf("engine2")
    for src, dst in ((srv2.cert, cert), (srv2.key, key), (other.cert, client_ca)):
        _write(dst, open(src).read())
    with Client(target, security=ChannelSecurity(other.cert, good2.cert, good2.key), timeout=5) as kv:
        assert kv.get_stats().service_id
    with pytest.raises(Unavailable):
        Client(target, security=engine, timeout=2).get_stats()


def test_the_peer_listener_serves_peers_only(make_server: Any, tmp_path: Any) -> None:
    ptoken = str(tmp_path / "peer-token")
    _write(ptoken, "peer-secret\n")
    s = make_server(insecure=False, tcp_address="", peer_tcp_address="127.0.0.1:0", peer_token_file=ptoken)
    assert s.app.peer_address == _tcp(s, peer=True)
    target = _tcp(s, peer=True)
    with grpc.insecure_channel(target) as ch:
        stub = peer_pb2_grpc.KVPeerStub(ch)
        for md in (None, [("kvservice-peer-token", "nope")]):
            with pytest.raises(grpc.RpcError) as info:
                stub.Handshake(peer_pb2.HandshakeRequest(), timeout=5, metadata=md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Handshake(
            peer_pb2.HandshakeRequest(service_id="t"),
            timeout=5,
            metadata=[("kvservice-peer-token", "peer-secret")],
        )
        assert ok.service_id
    assert _stats_code(target, [("kvservice-peer-token", "peer-secret")]) in (
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,  # KVService is not even registered there
    )


def test_grpcurl_with_a_token_and_with_client_certificates(make_server: Any, tmp_path: Any) -> None:
    """grpcurl (a client we did not write) against the secured TCP port: refused without the
    token, served with ``-H 'authorization: Bearer ...'``; with mutual TLS, served with
    ``-cacert -cert -key`` and refused without a certificate."""
    import shutil
    import subprocess

    g = shutil.which("grpcurl") or os.path.expanduser("~/go/bin/grpcurl")
    if not os.path.exists(g):
        pytest.skip("grpcurl not installed (scripts/test.sh installs it)")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([g, *args], capture_output=True, text=True, timeout=30)

    token = str(tmp_path / "token")
    _write(token, "grpcurl-secret\n")
    s = make_server(insecure=False, token_file=token)
    method = ("-d", "{}", _tcp(s), "kvservice.v1.KVService/GetStats")
    denied = run("-plaintext", *method)
    assert denied.returncode != 0 and "Unauthenticated" in denied.stderr, denied.stderr
    ok = run("-plaintext", "-H", "authorization: Bearer grpcurl-secret", *method)
    assert ok.returncode == 0 and s.node.service_id in ok.stdout, ok.stderr

    ca = CA(str(tmp_path), "grpcurl-ca")
    srv, cli = ca.leaf("kvservice"), ca.leaf("grpcurl")
    t = make_server(insecure=False, tls_cert=srv.cert, tls_key=srv.key, tls_client_ca=ca.cert)
    method = ("-d", "{}", _tcp(t), "kvservice.v1.KVService/GetStats")
    ok = run("-cacert", ca.cert, "-cert", cli.cert, "-key", cli.key, *method)
    assert ok.returncode == 0 and t.node.service_id in ok.stdout, ok.stderr
    assert run("-cacert", ca.cert, *method).returncode != 0  # no client certificate
