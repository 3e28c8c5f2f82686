"""GetStats as the operator view: admin identity is enough without a session (a
credential on the call, an admin certificate, an admin token), scoped callers are told so, and
the response carries activity per route, transfers in flight, peers and sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import grpc
import numpy as np
import pytest
from kvservice_client import ChannelSecurity, Client, Layout, ShmKVPool
from kvservice_client._proto import kvservice_pb2 as pb
from kvservice_client._proto import kvservice_pb2_grpc
from kvservice_client._session import fetch_credential

from kvservice.identity import Identity
from tests.support.grpcurl import grpcurl
from tests.support.pki import CA

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=16, total_kv_heads=2, head_dim=8, dtype="float16")


@pytest.fixture
def pool():
    with ShmKVPool.create(LAYOUT) as p:
        yield p


def _raw_stats(target: str, metadata: Any = (), creds: Any = None) -> pb.GetStatsResponse:
    ch = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
    with ch:
        return kvservice_pb2_grpc.KVServiceStub(ch).GetStats(
            pb.GetStatsRequest(), timeout=5, metadata=metadata
        )


def _write(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


def test_an_admin_uid_sees_every_buffer_set_with_a_credential_and_no_session(server, pool) -> None:
    """A kvservice-credential on GetStats alone (root: an admin uid) lists the whole node."""
    with Client(server.address, client_name="engine") as kv:
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        cred = fetch_credential(server.app.uds_path + ".cred")
        seen = _raw_stats(server.address, (("kvservice-credential", cred),))
        assert seen.admin_view and not seen.scope_note
        assert [b.buffer_set_id for b in seen.buffer_sets] == [bs] and seen.buffer_sets_total == 1
        assert [s.client_name for s in seen.session_list] == ["engine"]
        again = _raw_stats(server.address, (("kvservice-credential", cred),))  # single-use
        assert not again.admin_view and list(again.buffer_sets) == []


def test_a_caller_without_session_or_admin_identity_is_told_the_list_is_scoped(server, pool) -> None:
    """No session, no credential: no buffer sets, the total, and a note that says how to see them."""
    with Client(server.address) as kv:
        kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
        seen = _raw_stats(server.address)
        assert not seen.admin_view and list(seen.buffer_sets) == [] and seen.buffer_sets_total == 1
        assert "none of 1" in seen.scope_note and "admin_uids" in seen.scope_note
        assert list(seen.session_list) == [] and list(seen.peers) == []


def test_a_non_admin_session_sees_its_own_and_the_note_says_so(server, pool) -> None:
    """A session of a non-admin uid: its own buffer sets and session row, scoped, with a note."""
    node = server.node
    tenant, _ = node.sessions.open("tenant-b", Identity(4242, 4242, 1), admin=False)
    with Client(server.address) as kv:
        kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
        seen = _raw_stats(server.address, (("kvservice-session", tenant.session_id),))
    assert not seen.admin_view and "this session's own (0 of 1)" in seen.scope_note
    assert [(s.client_name, s.uid, s.admin) for s in seen.session_list] == [("tenant-b", 4242, False)]
    assert seen.session_list[0].session_ref == tenant.session_id[:8]


def test_grpcurl_over_the_socket_as_an_admin_shows_the_node(server, pool) -> None:
    """grpcurl with `kvservice credential` in a header lists the buffer sets."""
    g = grpcurl()
    with Client(server.address) as kv:
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        cred = subprocess.run(
            [sys.executable, "-m", "kvservice", "credential", "--address", server.address],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ},
        )
        assert cred.returncode == 0, cred.stderr
        out = subprocess.run(
            [g, "-plaintext", "-unix", "-H", f"kvservice-credential: {cred.stdout.strip()}", "-d", "{}"]
            + [server.app.uds_path, "kvservice.v1.KVService/GetStats"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["admin_view"] is True  # grpcurl prints proto field names
    assert [b["buffer_set_id"] for b in stats["buffer_sets"]] == [bs]


def test_an_admin_token_over_tcp_sees_the_node_without_a_session(make_server, pool, tmp_path) -> None:
    """A bearer token in admin_token_file (and token_file) is admin; another valid token is not."""
    tokens = _write(str(tmp_path / "tokens"), "engine-token\nops-token\n")
    admin = _write(str(tmp_path / "admin"), "ops-token\n")
    s = make_server(insecure=False, token_file=tokens, admin_token_file=admin)
    target = f"127.0.0.1:{s.app.tcp_port}"
    with Client(s.address) as kv:
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        ops = _raw_stats(target, (("authorization", "Bearer ops-token"),))
        assert ops.admin_view and [b.buffer_set_id for b in ops.buffer_sets] == [bs]
        engine = _raw_stats(target, (("authorization", "Bearer engine-token"),))
        assert not engine.admin_view and list(engine.buffer_sets) == [] and engine.scope_note


def test_an_admin_certificate_over_mutual_tls_sees_the_node(make_server, pool, tmp_path) -> None:
    """A client certificate named in admin_identities is admin; another of the same CA is not."""
    ca = CA(str(tmp_path))
    srv, ops, engine = ca.leaf("kvservice"), ca.leaf("ops-console"), ca.leaf("engine")
    s = make_server(
        insecure=False,
        tls_cert=srv.cert,
        tls_key=srv.key,
        tls_client_ca=ca.cert,
        admin_identities="ops-console",
    )
    target = f"127.0.0.1:{s.app.tcp_port}"
    with Client(s.address) as owner:
        bs = owner.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        with Client(target, security=ChannelSecurity(ca.cert, ops.cert, ops.key), timeout=5) as kv:
            seen = kv.get_stats()
            assert seen.admin_view and [b.buffer_set_id for b in seen.buffer_sets] == [bs]
        with Client(target, security=ChannelSecurity(ca.cert, engine.cert, engine.key), timeout=5) as kv:
            seen = kv.get_stats()
            assert not seen.admin_view and list(seen.buffer_sets) == []


def test_activity_peers_and_in_flight_after_transfers(make_server) -> None:
    """After transfers to a peer: activity per route with p50/p99, the peer READY with an RTT,
    and a declared transfer counted in flight as a receiver that is 'declared'."""
    a, b = make_server(transport="loopback"), make_server(transport="loopback")
    with ShmKVPool.create(LAYOUT) as pa, ShmKVPool.create(LAYOUT) as pb_, Client(a.address) as ka:
        with Client(b.address) as kb:
            sa = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
            sb = kb.register_buffers(LAYOUT, pb_.k_regions, pb_.v_regions).buffer_set_id
            for i in range(3):
                kb.expect_delta(f"t{i}", sb, prefix_pages=0, dst_page_indices=[1, 2], deadline_ms=10_000)
                ka.send_delta(f"t{i}", sa, src_page_indices=[3, 4], peer_address=b.app.peer_address)
                assert {st.state for st in kb.wait(f"t{i}", timeout=20)} == {"DONE"}
            ka.expect_delta("pending", sa, prefix_pages=0, dst_page_indices=[9], deadline_ms=30_000)
            seen = ka.get_stats(window_ms=60_000, probe_peers=True)
            (route,) = [r for r in seen.activity.routes if r.role == "sender"]
            assert route.done == route.done_total == 3 and route.bytes == route.bytes_total > 0
            assert 0 < route.p50_us <= route.p99_us and route.route in ("fused", "direct", "packed")
            (peer,) = seen.peers
            assert peer.address == b.app.peer_address and peer.service_id == b.node.service_id
            assert peer.channel_state == "READY" and peer.rtt_us > 0
            assert [(g.role, g.phase, g.transfers) for g in seen.in_flight] == [("receiver", "declared", 1)]
            (row,) = seen.session_list
            assert (row.buffer_sets, row.transfers_in_flight, row.attached) == (1, 1, True)
            received = kb.get_stats(window_ms=60_000)
            assert [(r.role, r.done) for r in received.activity.routes] == [("receiver", 3)]
            assert np.all(pb_.k(0)[[1, 2]] == pa.k(0)[[3, 4]])
