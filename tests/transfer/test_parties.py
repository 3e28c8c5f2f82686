"""Only a transfer's parties act on it, as attacks: a peer-token holder that is not
the sender, a forged commit of pages no data reached, a corrupted staging batch with integrity
on. After each, the victim's transfer completes byte for byte."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from kvservice_client._proto import peer_pb2, peer_pb2_grpc

from kvservice.transfer.routes import packed as packed_mod
from tests.support.peers import DST, LAYOUT, SRC, PeerNode, mtls_config, secure_node
from tests.support.pki import CA
from tests.support.poll import eventually
from tests.support.pools import assert_pages_equal, assert_unchanged, snapshot
from tests.support.transfers import one


@pytest.fixture
def nodes() -> Any:
    made: list[PeerNode] = []
    yield made
    for n in made:
        n.client.close()


def _token(tmp_path: Any) -> str:
    path = tmp_path / "peer-token"
    path.write_text("cluster-secret\n")
    return str(path)


def _code(fn: Any) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_token_peer_that_is_not_the_sender_cannot_act_on_the_transfer(
    make_server, make_pool, tmp_path, nodes
) -> None:
    """Peer tokens: while the real sender is mid-transfer, a token holder naming the sender's
    service id cannot commit (last, all pages), reserve staging, re-fetch the plan or abort
    either side; before any plan it cannot abort the receiver. The sender then finishes: DONE,
    byte-exact."""
    token = tmp_path / "peer-token"
    token.write_text("cluster-secret\n")
    a = secure_node(make_server, make_pool, 1, peer_token_file=str(token))
    b = secure_node(make_server, make_pool, 2, peer_token_file=str(token))
    nodes += [a, b]
    peer = b.server.app.peer_address
    victim = a.server.node.service_id
    md = (("kvservice-peer-token", "cluster-secret"),)
    b.client.expect_delta("t-tok", b.bs, prefix_pages=0, dst_page_indices=DST, deadline_ms=20_000)
    with grpc.insecure_channel(peer) as ch:
        stub = peer_pb2_grpc.KVPeerStub(ch)
        abort = peer_pb2.PeerAbortRequest(transfer_id="t-tok", origin_service_id=victim, reason="evil")
        assert not stub.Abort(abort, metadata=md, timeout=5).known  # before any plan
        a.client.send_delta("t-tok", a.bs, src_page_indices=SRC[:2], peer_address=peer, last_chunk=False)
        eventually(lambda: b.client.poll(["t-tok"])[0].chunks_done >= 1, what="first chunk landed")
        commit = peer_pb2.CommitChunkRequest(
            transfer_id="t-tok",
            dst_buffer_set_id=b.bs,
            sender_service_id=victim,
            positions=list(range(len(DST))),
            last_chunk=True,
        )
        reserve = peer_pb2.ReserveStagingRequest(transfer_id="t-tok", dst_buffer_set_id=b.bs, nbytes=64)
        plan = peer_pb2.GetReceivePlanRequest(
            transfer_id="t-tok", sender_service_id=victim, src_layout=LAYOUT.to_proto(), wait_ms=100
        )
        denied = grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: stub.CommitChunk(commit, metadata=md, timeout=5)) == denied
        assert _code(lambda: stub.ReserveStaging(reserve, metadata=md, timeout=5)) == denied
        assert _code(lambda: stub.GetReceivePlan(plan, metadata=md, timeout=5)) == denied
        assert not stub.Abort(abort, metadata=md, timeout=5).known
        with grpc.insecure_channel(a.server.app.peer_address) as ch_a:  # the sender's side too
            origin = b.server.node.service_id
            back = peer_pb2.PeerAbortRequest(transfer_id="t-tok", origin_service_id=origin, reason="evil")
            assert not peer_pb2_grpc.KVPeerStub(ch_a).Abort(back, metadata=md, timeout=5).known
    assert b.client.poll(["t-tok"])[0].state == "TRANSFERRING"
    a.client.send_delta(
        "t-tok", a.bs, src_page_indices=SRC[2:], chunk_offset=2, peer_address=peer, last_chunk=True
    )
    assert (one(a.client, "t-tok").state, one(b.client, "t-tok").state) == ("DONE", "DONE")
    assert_pages_equal(b.pool, DST, a.pool, SRC)


def test_a_forged_commit_of_unwritten_pages_fails_instead_of_done(
    make_server, make_pool, tmp_path, nodes
) -> None:
    """A token holder that fetched the plan first commits every page DIRECT with last_chunk and no
    byte written: with integrity on, the receiver FAILS the transfer (not DONE), nothing is
    published into the index and no page changed. The victim's retry, declared with the
    sender's address, is DONE and byte-exact."""
    token = tmp_path / "peer-token"
    token.write_text("cluster-secret\n")
    a = secure_node(make_server, make_pool, 1, peer_token_file=str(token))
    b = secure_node(make_server, make_pool, 2, peer_token_file=str(token))
    nodes += [a, b]
    peer = b.server.app.peer_address
    before = snapshot(b.pool)
    tokens = list(range(len(DST) * LAYOUT.page_size))
    b.client.expect_delta(
        "t-forge", b.bs, prefix_pages=0, dst_page_indices=DST, deadline_ms=20_000, publish_tokens=tokens
    )
    md = (("kvservice-peer-token", "cluster-secret"),)
    with grpc.insecure_channel(peer) as ch:
        stub = peer_pb2_grpc.KVPeerStub(ch)
        got = stub.GetReceivePlan(
            peer_pb2.GetReceivePlanRequest(
                transfer_id="t-forge", sender_service_id="forger", src_layout=LAYOUT.to_proto(), wait_ms=1000
            ),
            metadata=md,
            timeout=5,
        )
        (plan,) = got.plans
        assert plan.integrity and plan.sender_ticket
        forged = peer_pb2.CommitChunkRequest(
            transfer_id="t-forge",
            dst_buffer_set_id=b.bs,
            sender_service_id="forger",
            positions=list(range(len(DST))),
            last_chunk=True,
            num_heads=LAYOUT.local_kv_heads,
            sender_ticket=plan.sender_ticket,
        )
        assert (
            _code(lambda: stub.CommitChunk(forged, metadata=md, timeout=5))
            == grpc.StatusCode.FAILED_PRECONDITION
        )
    st = one(b.client, "t-forge")
    assert st.state == "FAILED" and "checksum" in st.error, st
    held = b.client.match_prefix(tokens=tokens, page_size=LAYOUT.page_size).matches
    assert all(m.matched_pages == 0 for m in held)  # the index is not poisoned
    assert_unchanged(b.pool, before)
    b.client.expect_delta("t-retry", b.bs, prefix_pages=0, dst_page_indices=DST, publish_tokens=tokens)
    a.client.send_delta("t-retry", a.bs, src_page_indices=SRC, peer_address=peer)
    assert (one(a.client, "t-retry").state, one(b.client, "t-retry").state) == ("DONE", "DONE")
    assert_pages_equal(b.pool, DST, a.pool, SRC)


def test_sender_address_fills_allowed_senders_over_mutual_tls(
    make_server, make_pool, tmp_path, nodes
) -> None:
    """ExpectDelta naming the sender's address (no allowed_senders): another cluster member with a
    valid certificate cannot fetch the plan first; the named sender delivers byte-exact."""
    ca = CA(str(tmp_path), "cluster")
    a = secure_node(make_server, make_pool, 1, **mtls_config(ca, "prefill-a"))
    c = secure_node(make_server, make_pool, 3, **mtls_config(ca, "prefill-c"))
    b = secure_node(make_server, make_pool, 2, **mtls_config(ca, "decode-b"))
    nodes += [a, b, c]
    peer = b.server.app.peer_address
    before = snapshot(b.pool)
    b.client.expect_delta(
        "t-auto", b.bs, prefix_pages=0, dst_page_indices=DST, sender_address=a.server.app.peer_address
    )
    c.client.send_delta("t-auto", c.bs, src_page_indices=SRC, peer_address=peer)
    sc = one(c.client, "t-auto")
    assert sc.state == "FAILED" and sc.error_code == "PERMISSION_DENIED", sc
    assert_unchanged(b.pool, before)
    a.client.send_delta("t-auto", a.bs, src_page_indices=SRC, peer_address=peer)
    assert (one(a.client, "t-auto").state, one(b.client, "t-auto").state) == ("DONE", "DONE")
    assert_pages_equal(b.pool, DST, a.pool, SRC)


def test_a_corrupted_staging_batch_fails_with_integrity_on(
    make_server, make_pool, monkeypatch, tmp_path, nodes
) -> None:
    """A packed batch corrupted after the sender hashed it (in transit): the receiver's check fails
    the transfer before unpacking, no page changes; the next transfer is DONE and byte-exact."""
    a = secure_node(make_server, make_pool, 1, peer_token_file=_token(tmp_path))
    b = secure_node(make_server, make_pool, 2, peer_token_file=_token(tmp_path))
    nodes += [a, b]
    peer = b.server.app.peer_address
    before = snapshot(b.pool)
    real = packed_mod.pack_hashed

    async def corrupting(plan: Any, target: Any, regions: Any, src: Any, view: Any) -> Any:
        check = await real(plan, target, regions, src, view)
        view[view.numel() // 2] ^= 0x5A  # one byte flips between the hash and the wire
        return check

    monkeypatch.setattr(packed_mod, "pack_hashed", corrupting)
    b.client.expect_delta("t-bad", b.bs, prefix_pages=0, dst_page_indices=DST, deadline_ms=20_000)
    a.client.send_delta("t-bad", a.bs, src_page_indices=SRC, peer_address=peer, path="packed")
    st = one(b.client, "t-bad")
    assert st.state == "FAILED" and "checksum" in st.error, st
    assert one(a.client, "t-bad").state == "FAILED"
    assert_unchanged(b.pool, before)
    monkeypatch.setattr(packed_mod, "pack_hashed", real)
    b.client.expect_delta("t-good", b.bs, prefix_pages=0, dst_page_indices=DST)
    a.client.send_delta("t-good", a.bs, src_page_indices=SRC, peer_address=peer, path="packed")
    assert (one(a.client, "t-good").state, one(b.client, "t-good").state) == ("DONE", "DONE")
    assert_pages_equal(b.pool, DST, a.pool, SRC)
