"""Services authenticate each other: KVPeer over mutual TLS (one cluster CA) or a shared peer
token; a declaration can name which sender identities may write it; a commit comes only from
the peer that fetched the plan. Every refused attempt leaves the receiver's pages as they were.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from kvservice_client._proto import peer_pb2, peer_pb2_grpc

from tests.support.peers import DST, SRC, PeerNode, mtls_config, secure_node
from tests.support.pki import CA
from tests.support.pools import assert_pages_equal, assert_unchanged, snapshot
from tests.support.transfers import one


@pytest.fixture
def nodes() -> Any:
    made: list[PeerNode] = []
    yield made
    for n in made:
        n.client.close()


def test_mutual_tls_between_services_and_allowed_senders(make_server, make_pool, tmp_path, nodes) -> None:
    ca, rogue_ca = CA(str(tmp_path), "cluster"), CA(str(tmp_path), "rogue")
    a = secure_node(make_server, make_pool, 1, **mtls_config(ca, "prefill-a"))
    c = secure_node(
        make_server, make_pool, 3, **mtls_config(ca, "prefill-c")
    )  # a member, but not the one named
    x = secure_node(make_server, make_pool, 4, **mtls_config(rogue_ca, "intruder"))  # not of the cluster
    b = secure_node(make_server, make_pool, 2, **mtls_config(ca, "decode-b"))
    nodes += [a, b, c, x]
    peer = b.server.app.peer_address
    before = snapshot(b.pool)

    # a certificate of another CA cannot even connect: its transfer fails, nothing is written
    b.client.expect_delta("t-x", b.bs, prefix_pages=0, dst_page_indices=DST, deadline_ms=3000)
    x.client.send_delta("t-x", x.bs, src_page_indices=SRC, peer_address=peer)
    sx = one(x.client, "t-x")
    assert sx.state == "FAILED" and sx.error_code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), sx
    rx = one(b.client, "t-x")
    assert rx.state == "FAILED" and rx.error_code == "DEADLINE_EXCEEDED", rx
    assert_unchanged(b.pool, before)

    # the declaration names prefill-a: prefill-c (valid certificate) is refused, then a delivers
    b.client.expect_delta("t-1", b.bs, prefix_pages=0, dst_page_indices=DST, allowed_senders=["prefill-a"])
    c.client.send_delta("t-1", c.bs, src_page_indices=SRC, peer_address=peer)
    sc = one(c.client, "t-1")
    assert sc.state == "FAILED" and sc.error_code == "PERMISSION_DENIED" and "prefill-c" in sc.error, sc
    assert_unchanged(b.pool, before)
    assert b.client.poll(["t-1"])[0].state in ("PENDING", "TRANSFERRING")  # still waits for a
    a.client.send_delta("t-1", a.bs, src_page_indices=SRC, peer_address=peer)
    assert one(a.client, "t-1").state == "DONE"
    assert one(b.client, "t-1").state == "DONE"
    assert_pages_equal(b.pool, DST, a.pool, SRC)


def test_a_commit_without_the_plan_is_refused(make_server, make_pool, tmp_path, nodes) -> None:
    ca = CA(str(tmp_path), "cluster")
    b = secure_node(make_server, make_pool, 2, **mtls_config(ca, "decode-b"))
    nodes.append(b)
    before = snapshot(b.pool)
    b.client.expect_delta("t-forge", b.bs, prefix_pages=0, dst_page_indices=DST, deadline_ms=2000)
    leaf = ca.leaf("member")
    creds = grpc.ssl_channel_credentials(
        open(ca.cert, "rb").read(), open(leaf.key, "rb").read(), open(leaf.cert, "rb").read()
    )
    with grpc.secure_channel(b.server.app.peer_address, creds) as ch:
        stub = peer_pb2_grpc.KVPeerStub(ch)
        assert stub.Handshake(peer_pb2.HandshakeRequest(service_id="forger"), timeout=5).service_id
        with pytest.raises(grpc.RpcError) as info:
            stub.CommitChunk(
                peer_pb2.CommitChunkRequest(
                    transfer_id="t-forge",
                    dst_buffer_set_id=b.bs,
                    sender_service_id="forger",
                    positions=[0, 1],
                    last_chunk=True,
                ),
                timeout=5,
            )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "no receive plan" in info.value.details()
    assert one(b.client, "t-forge").error_code == "DEADLINE_EXCEEDED"  # nobody completed it
    assert_unchanged(b.pool, before)


def test_peer_token_between_services(make_server, make_pool, tmp_path, nodes) -> None:
    good, bad = tmp_path / "peer-token", tmp_path / "wrong-token"
    good.write_text("cluster-secret\n")
    bad.write_text("guess\n")
    a = secure_node(make_server, make_pool, 1, peer_token_file=str(good))
    x = secure_node(make_server, make_pool, 3, peer_token_file=str(bad))
    b = secure_node(make_server, make_pool, 2, peer_token_file=str(good))
    nodes += [a, b, x]
    peer = b.server.app.peer_address
    before = snapshot(b.pool)
    b.client.expect_delta("t-bad", b.bs, prefix_pages=0, dst_page_indices=DST, deadline_ms=2000)
    x.client.send_delta("t-bad", x.bs, src_page_indices=SRC, peer_address=peer)
    sx = one(x.client, "t-bad")
    assert sx.state == "FAILED" and sx.error_code == "UNAUTHENTICATED", sx
    assert_unchanged(b.pool, before)
    b.client.expect_delta("t-ok", b.bs, prefix_pages=0, dst_page_indices=DST)
    a.client.send_delta("t-ok", a.bs, src_page_indices=SRC, peer_address=peer)
    assert (one(a.client, "t-ok").state, one(b.client, "t-ok").state) == ("DONE", "DONE")
    assert_pages_equal(b.pool, DST, a.pool, SRC)
    # a token proves membership, not which service: a declaration naming identities refuses it
    b.client.expect_delta(
        "t-named", b.bs, prefix_pages=0, dst_page_indices=DST, allowed_senders=["prefill-a"], deadline_ms=2000
    )
    a.client.send_delta("t-named", a.bs, src_page_indices=SRC, peer_address=peer)
    assert one(a.client, "t-named").error_code == "PERMISSION_DENIED"
