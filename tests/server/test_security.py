"""Caller identity and memory ownership: the attack found by hand — a TCP
caller registering another engine's shm pool and listing every engine's buffer sets — is refused,
and SendDelta aims only at allowlisted peers."""

from __future__ import annotations

import os
import socket
from typing import Any

import grpc
import numpy as np
import pytest
from kvservice_client import Client, Layout, PermissionDenied, ShmKVPool
from kvservice_client._proto import kvservice_pb2 as pb
from kvservice_client._proto import kvservice_pb2_grpc

from kvservice import errors
from kvservice.identity import Identity
from kvservice.peers_allow import parse_allowlist, peer_allowed

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=8, total_kv_heads=2, head_dim=8, dtype="float16")


@pytest.fixture
def pool():
    with ShmKVPool.create(LAYOUT) as p:
        yield p


def test_a_tcp_caller_without_local_identity_cannot_register_memory(server, pool) -> None:
    """The hand-found attack: over TCP, registering an engine's shm pool is PERMISSION_DENIED."""
    with Client(f"127.0.0.1:{server.app.tcp_port}") as kv:
        with pytest.raises(PermissionDenied, match="identified local caller"):
            kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
    assert len(server.node.buffers) == 0


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the segment another owner")
def test_a_local_caller_cannot_register_a_segment_it_does_not_own(server, pool) -> None:
    """The owner is read from /dev/shm, not claimed: someone else's segment is refused, by field."""
    os.chown("/dev/shm/" + pool.name.lstrip("/"), 65534, 65534)
    with Client(server.address) as kv:
        with pytest.raises(PermissionDenied, match=r"k_regions\[0\]\.shm\.name.*uid 65534"):
            kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
    assert len(server.node.buffers) == 0


def test_the_uds_session_carries_the_kernel_identity(server, pool) -> None:
    """A session opened over the socket has this process's uid/pid as the kernel reports them."""
    with Client(server.address) as kv:
        s = server.node.sessions.find(kv.session_id)
        assert s.identity == Identity(os.getuid(), os.getgid(), os.getpid())


def test_credentials_are_single_use_and_unknown_ones_are_refused(server) -> None:
    """A forged or replayed kvservice-credential is UNAUTHENTICATED; nothing opens."""
    path = server.app.uds_path + ".cred"
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        token = s.recv(64).decode().strip()
    with grpc.insecure_channel(server.address) as ch:
        stub = kvservice_pb2_grpc.KVServiceStub(ch)
        first = stub.OpenSession(pb.OpenSessionRequest(), metadata=(("kvservice-credential", token),))
        assert next(first).session_id
        for bad in (token, "0" * 32):
            again = stub.OpenSession(pb.OpenSessionRequest(), metadata=(("kvservice-credential", bad),))
            with pytest.raises(grpc.RpcError) as info:
                next(again)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "kvservice-credential" in info.value.details()
        first.cancel()


def test_get_stats_lists_only_the_callers_own_buffer_sets_unless_admin(server, pool) -> None:
    """A non-admin session sees its own buffer sets; a caller without a session sees none."""
    node = server.node
    with Client(server.address) as owner:
        mine = owner.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        assert [b.buffer_set_id for b in owner.get_stats().buffer_sets] == [mine]  # root: admin
        other, _ = node.sessions.open("tenant-b", Identity(4242, 4242, 1), admin=False)
        with grpc.insecure_channel(server.address) as ch:
            stub = kvservice_pb2_grpc.KVServiceStub(ch)
            seen = stub.GetStats(pb.GetStatsRequest(), metadata=(("kvservice-session", other.session_id),))
            assert list(seen.buffer_sets) == [] and seen.sessions == 2
            assert list(stub.GetStats(pb.GetStatsRequest()).buffer_sets) == []
        with pytest.raises(errors.PermissionDenied):
            node.buffers.get(mine, other.session_id)  # naming it anywhere else is refused too


def test_send_delta_aims_only_at_allowlisted_peers(make_server, pool) -> None:
    """peer_allowlist without loopback: SendDelta to 127.0.0.1 is refused before anything is queued."""
    server = make_server(peer_allowlist="10.0.0.0/8, .svc.cluster.local")
    with Client(server.address) as kv, ShmKVPool.create(LAYOUT) as dst:
        a = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        b = kv.register_buffers(LAYOUT, dst.k_regions, dst.v_regions).buffer_set_id
        kv.expect_delta("t", b, prefix_pages=0, dst_page_indices=[1], deadline_ms=5_000)
        with pytest.raises(PermissionDenied, match="peer_address.*peer_allowlist"):
            kv.send_delta("t", a, src_page_indices=[0], peer_address=server.app.peer_address)
        assert [s.role for s in kv.poll(["t"])] == ["RECEIVER"]
        kv.abort("t")


def test_allowlist_matching() -> None:
    """CIDRs match IPs, suffixes match names (never resolved), 'unix' matches Unix sockets."""
    allow = parse_allowlist("10.0.0.0/8, .svc.cluster.local, decode-0, unix")
    assert peer_allowed("10.1.2.3:50051", allow) and peer_allowed("ipv4:10.9.9.9:1", allow)
    assert peer_allowed("kv.ns.svc.cluster.local:50051", allow) and peer_allowed("decode-0:1", allow)
    assert peer_allowed("unix:/run/kvservice/kvservice.sock", allow)
    assert not peer_allowed("11.0.0.1:50051", allow) and not peer_allowed("evil.example.com:1", allow)
    assert not peer_allowed("10.0.0.1.evil.com:1", allow)
    assert not peer_allowed("unix:/tmp/x.sock", parse_allowlist("10.0.0.0/8"))
    with pytest.raises(ValueError):
        parse_allowlist("10.0.0.0/99")
    assert np.array_equal(np.array(parse_allowlist("")), np.array(()))


def test_allowed_uids_decide_who_opens_sessions_on_the_socket(make_server) -> None:
    """With allowed_uids, a credential the kernel issued to another uid is refused on OpenSession,
    naming the uid; a listed uid opens an identified session; an anonymous session over the
    socket is refused. (The kernel's side, SO_PEERCRED, is test_the_uds_session_carries_...)"""
    s = make_server(allowed_uids="12345")

    def open_as(uid: int, server: Any) -> Any:
        credential = server.node.credentials.issue(Identity(uid, uid, 4242))
        with grpc.insecure_channel(server.address) as ch:
            call = kvservice_pb2_grpc.KVServiceStub(ch).OpenSession(
                pb.OpenSessionRequest(), metadata=(("kvservice-credential", credential),) if uid >= 0 else ()
            )
            try:
                return next(call).session_id
            except grpc.RpcError as exc:
                return exc
            finally:
                call.cancel()

    refused = open_as(65534, s)
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "allowed_uids: uid 65534" in refused.details()
    assert isinstance(open_as(12345, s), str) and isinstance(open_as(0, s), str)  # listed; root
    anonymous = open_as(-1, s)
    assert isinstance(anonymous, grpc.RpcError) and "identified" in anonymous.details()
    with Client(s.address) as kv:  # the SDK always identifies itself over the socket
        assert kv.session_id
