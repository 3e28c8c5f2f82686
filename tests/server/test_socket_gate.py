"""The engine socket serves engines: KVPeer there only for a co-located kvservice of
this service's uid or of ``peer_uids``; every call there, sessionless ones included, obeys
``allowed_uids``. Each attack leaves the victim's transfer to complete byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvservice_client import Client, Layout, ShmKVPool
from kvservice_client._proto import common_pb2, kvservice_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvservice_client._proto import kvservice_pb2 as pb

from kvservice.identity import Identity

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=8, total_kv_heads=2, head_dim=8, dtype="float16")
OTHER_UID = 65534


def _uds_only(make_server: Any, **overrides: Any) -> Any:
    return make_server(tcp_address="", transport="loopback", same_host_route="off", **overrides)


def _cred(server: Any, uid: int) -> tuple[tuple[str, str], ...]:
    """A credential as the kernel would have issued it to a process of ``uid``."""
    return (("kvservice-credential", server.node.credentials.issue(Identity(uid, uid, 4242))),)


def _code(fn: Any) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


class Victim:
    """Engine a (sender) on service ``sa`` and engine b (receiver) on ``sb``, both over Unix sockets."""

    def __init__(self, sa: Any, sb: Any) -> None:
        self.sb = sb
        self.src, self.dst = ShmKVPool.create(LAYOUT), ShmKVPool.create(LAYOUT)
        rng = np.random.default_rng(7)
        for page in self.pages(self.src):
            page[:] = rng.integers(0, 255, page.shape, dtype=np.uint8)
        self.a, self.b = Client(sa.address, timeout=10), Client(sb.address, timeout=10)
        self.bs_a = self.a.register_buffers(LAYOUT, self.src.k_regions, self.src.v_regions).buffer_set_id
        self.bs_b = self.b.register_buffers(LAYOUT, self.dst.k_regions, self.dst.v_regions).buffer_set_id
        self.src_pages, self.dst_pages = [3, 0, 6], [7, 2, 1]

    def expect(self, tid: str) -> None:
        self.b.expect_delta(
            tid, self.bs_b, prefix_pages=0, dst_page_indices=self.dst_pages, deadline_ms=20_000
        )

    def send_and_check(self, tid: str) -> None:
        self.a.send_delta(
            tid, self.bs_a, src_page_indices=self.src_pages, peer_address=self.sb.address, last_chunk=True
        )
        for kv in (self.a, self.b):
            (st,) = kv.wait(tid, timeout=15)
            assert st.state == "DONE", st
        for s, d in zip(self.pages(self.src), self.pages(self.dst), strict=True):
            assert np.array_equal(d[self.dst_pages], s[self.src_pages])

    @staticmethod
    def pages(pool: ShmKVPool) -> list[np.ndarray]:
        """Every K and V region as (pages, page bytes)."""
        return [f(layer) for layer in range(LAYOUT.num_layers) for f in (pool.k, pool.v)]

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.src.close()
        self.dst.close()


@pytest.fixture
def two_services(make_server: Any) -> Any:
    return _uds_only(make_server), _uds_only(make_server)


def _handshake(stub: Any, md: Any) -> grpc.StatusCode:
    return _code(lambda: stub.Handshake(peer_pb2.HandshakeRequest(), metadata=md, timeout=5))


def _stats(stub: Any, md: Any) -> grpc.StatusCode:
    return _code(lambda: stub.GetStats(pb.GetStatsRequest(), metadata=md, timeout=5))


def _peer_attacks(stub: Any, tid: str, bs_b: str, md: Any) -> list[grpc.StatusCode]:
    plan = peer_pb2.GetReceivePlanRequest(
        transfer_id=tid, sender_service_id="evil", src_layout=LAYOUT.to_proto(), wait_ms=100
    )
    commit = peer_pb2.CommitChunkRequest(
        transfer_id=tid,
        dst_buffer_set_id=bs_b,
        sender_service_id="evil",
        last_chunk=True,
        positions=[0, 1, 2],
    )
    abort = peer_pb2.PeerAbortRequest(transfer_id=tid, origin_service_id="evil", reason="x")
    return [
        _code(lambda: stub.Handshake(peer_pb2.HandshakeRequest(), metadata=md, timeout=5)),
        _code(lambda: stub.GetReceivePlan(plan, metadata=md, timeout=5)),
        _code(lambda: stub.CommitChunk(commit, metadata=md, timeout=5)),
        _code(lambda: stub.Abort(abort, metadata=md, timeout=5)),
    ]


def test_another_uid_gets_no_kvpeer_on_the_socket(two_services: Any) -> None:
    """Another uid (no allowed_uids), an anonymous caller and an engine's session: Handshake, the
    victim's plan, a forged last commit and an abort are all PERMISSION_DENIED; the victim's
    transfer (its services talk KVPeer over their sockets) then completes byte-exact."""
    sa, sb = two_services
    v = Victim(sa, sb)
    try:
        v.expect("t-uds")
        with grpc.insecure_channel(sb.address) as ch:
            stub = peer_pb2_grpc.KVPeerStub(ch)
            for md in (_cred(sb, OTHER_UID), (), (("kvservice-session", v.b.session_id),)):
                codes = _peer_attacks(stub, "t-uds", v.bs_b, md)
                assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 4, (md, codes)
        (st,) = v.b.poll(["t-uds"])
        assert st.state == "PENDING"
        v.send_and_check("t-uds")
    finally:
        v.close()


def test_peer_uids_admit_a_colocated_service_of_another_uid(make_server: Any) -> None:
    """A credential of a uid in peer_uids gets KVPeer (Handshake); the same uid is refused where
    it is not configured, and a credential is single-use."""
    s = _uds_only(make_server, peer_uids=str(OTHER_UID))
    plain = _uds_only(make_server)
    for server, want in ((s, grpc.StatusCode.OK), (plain, grpc.StatusCode.PERMISSION_DENIED)):
        with grpc.insecure_channel(server.address) as ch:
            stub = peer_pb2_grpc.KVPeerStub(ch)
            md = _cred(server, OTHER_UID)
            assert _handshake(stub, md) == want
            if want == grpc.StatusCode.OK:  # replayed
                assert _handshake(stub, md) == grpc.StatusCode.PERMISSION_DENIED


def test_allowed_uids_cover_sessionless_calls_on_the_socket(make_server: Any) -> None:
    """With allowed_uids: GetStats and MatchPrefix from another uid or an anonymous caller are
    PERMISSION_DENIED naming the option; an allowed uid (by credential) and the SDK (root,
    sessionless router calls) are served; health stays open; a transfer still works."""
    s = _uds_only(make_server, allowed_uids="12345")
    match = pb.MatchPrefixRequest(
        tokens=common_pb2.TokenIds(u32le=np.arange(8, dtype="<u4").tobytes()), page_size=4
    )
    with grpc.insecure_channel(s.address) as ch:
        stub = kvservice_pb2_grpc.KVServiceStub(ch)
        for md in (_cred(s, OTHER_UID), ()):
            for call in (
                lambda md=md: stub.GetStats(pb.GetStatsRequest(), metadata=md, timeout=5),
                lambda md=md: stub.MatchPrefix(match, metadata=md, timeout=5),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "allowed_uids" in info.value.details()
        assert stub.GetStats(pb.GetStatsRequest(), metadata=_cred(s, 12345), timeout=5).service_id
        st_ = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert st_ == health_pb2.HealthCheckResponse.SERVING
        other, _ = s.node.sessions.open("tenant-b", Identity(OTHER_UID, OTHER_UID, 1))
        with pytest.raises(grpc.RpcError) as info:  # a session of a uid no longer allowed
            stub.GetStats(
                pb.GetStatsRequest(), metadata=(("kvservice-session", other.session_id),), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with Client(s.address, timeout=5) as router:
        assert router.match_prefix(tokens=list(range(8)), page_size=4).query_pages == 2
        assert router.get_stats().service_id
    v = Victim(s, s)
    try:
        v.expect("t-allowed")
        v.send_and_check("t-allowed")
    finally:
        v.close()


# The other uid's process: a fresh interpreter started as root (no threads: not a fork of this
# process, whose gRPC threads make a forked child fragile) that imports what it needs, drops to
# ``uid``, fetches its own credential from the kernel's side and calls KVPeer and GetStats.
_CALLS_AS = """
import os, sys
import grpc
from kvservice_client._proto import kvservice_pb2, kvservice_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvservice_client._session import fetch_credential
uid, cred, address = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
out = []
for method in ("peer", "stats"):
    md = (("kvservice-credential", fetch_credential(cred)),)
    with grpc.insecure_channel(address) as ch:
        try:
            if method == "peer":
                peer_pb2_grpc.KVPeerStub(ch).Handshake(peer_pb2.HandshakeRequest(), metadata=md, timeout=5)
            else:
                stub = kvservice_pb2_grpc.KVServiceStub(ch)
                stub.GetStats(kvservice_pb2.GetStatsRequest(), metadata=md, timeout=5)
            out.append("OK")
        except grpc.RpcError as e:
            out.append(e.code().name)
print(",".join(out))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_the_kernel_identity_decides_not_the_claim(make_server: Any) -> None:
    """A real process of another uid fetching its own credential is refused
    KVPeer and, with allowed_uids, GetStats."""
    s = _uds_only(make_server, allowed_uids="12345", uds_mode="0666")
    os.chmod(os.path.dirname(s.app.uds_path), 0o755)
    p = subprocess.run(
        [sys.executable, "-c", _CALLS_AS, str(OTHER_UID), s.app.uds_path + ".cred", s.address],
        capture_output=True,
        timeout=60,
        check=False,
    )
    got = p.stdout.decode().strip()
    assert p.returncode == 0 and got == "PERMISSION_DENIED,PERMISSION_DENIED", (
        got,
        p.stderr.decode()[-2000:],
    )
