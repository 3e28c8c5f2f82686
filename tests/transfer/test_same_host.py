"""Two services on one host: the receiver hands its pools over and the sender copies page to page
into them (FUSED) — and when that cannot happen, the transport carries the pages and the sender's
status and log say why, once.
"""

from __future__ import annotations

import logging
import os
import socket

import grpc
import pytest
from kvservice_client import Client, Layout
from kvservice_client._proto import peer_pb2, peer_pb2_grpc

from kvservice import host
from tests.support.pools import assert_pages_equal, assert_unchanged, fill_random, snapshot
from tests.support.transfers import one

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=32, total_kv_heads=2, head_dim=8, dtype="float16")


def _link(sa, sb, make_pool, make_client):  # type: ignore[no-untyped-def]
    pa, pb = make_pool(LAYOUT), make_pool(LAYOUT)
    fill_random(pa, 1)
    fill_random(pb, 2)
    ka, kb = make_client(sa), make_client(sb)
    a = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
    b = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
    return ka, kb, pa, pb, a, b


def _move(ka: Client, kb: Client, a: str, b: str, peer: str, tid: str, path: str = "auto"):  # type: ignore[no-untyped-def]
    kb.expect_delta(tid, b, prefix_pages=1, dst_page_indices=[7, 3, 9])
    ka.send_delta(tid, a, src_page_indices=[0, 4, 5, 6], peer_address=peer, path=path)
    return one(kb, tid), one(ka, tid)


def test_same_host_services_copy_page_to_page(make_server, make_pool, make_client) -> None:
    sa, sb = make_server(transport="loopback"), make_server(transport="loopback")
    ka, kb, pa, pb, a, b = _link(sa, sb, make_pool, make_client)
    before = snapshot(pb)
    r, s = _move(ka, kb, a, b, sb.app.peer_address, "fused")
    assert (r.state, s.state, r.path, s.path) == ("DONE", "DONE", "FUSED", "FUSED"), (r, s)
    assert (s.pages_sent, s.pages_skipped, s.route_note) == (3, 1, ""), s
    assert_pages_equal(pb, [7, 3, 9], pa, [4, 5, 6])
    assert_unchanged(pb, before, except_pages=[7, 3, 9])
    assert len(sa.app.node.transfers.dispatch.peer_pools) == 1  # mapped once, kept for the next transfer


def test_pools_that_cannot_be_opened_fall_back_with_the_reason(
    make_server, make_pool, make_client, caplog
) -> None:
    """The receiver's segment is gone from /dev/shm (as from another IPC namespace): the sender cannot
    open it, so the pages go through the transport; the status and one log line say why."""
    sa, sb = make_server(transport="loopback"), make_server(transport="loopback")
    ka, kb, pa, pb, a, b = _link(sa, sb, make_pool, make_client)
    os.unlink(f"/dev/shm/{pb.name.lstrip('/')}")  # the receiver's service keeps its mapping
    before = snapshot(pb)
    with caplog.at_level(logging.WARNING, logger="kvservice.transfer.dispatch"):
        r, s = _move(ka, kb, a, b, sb.app.peer_address, "fb-1")
        r2, s2 = _move(ka, kb, a, b, sb.app.peer_address, "fb-2")
    for st in (r, s, r2, s2):
        assert st.state == "DONE" and st.path in ("DIRECT", "PACKED"), st
    assert "cannot open the receiver's pools" in s.route_note and "transport" in s.route_note, s
    assert s2.route_note == s.route_note
    assert_pages_equal(pb, [7, 3, 9], pa, [4, 5, 6])
    assert_unchanged(pb, before, except_pages=[7, 3, 9])
    lines = [rec for rec in caplog.records if "same-host fused route not taken" in rec.getMessage()]
    assert len(lines) == 1, lines  # once per peer and reason, not per transfer
    kb.expect_delta("fb-3", b, prefix_pages=0, dst_page_indices=[1], deadline_ms=3000)
    ka.send_delta("fb-3", a, src_page_indices=[1], peer_address=sb.app.peer_address, path="fused")
    st = one(ka, "fb-3")  # FUSED asked for where it cannot be taken: fails, naming why
    assert (st.state, st.error_code) == ("FAILED", "FAILED_PRECONDITION") and "FUSED" in st.error, st
    assert "cannot open" in st.error, st


def test_receiver_with_route_off_refuses_and_says_so(make_server, make_pool, make_client) -> None:
    sa = make_server(transport="loopback")
    sb = make_server(transport="loopback", same_host_route="off")
    ka, kb, pa, pb, a, b = _link(sa, sb, make_pool, make_client)
    r, s = _move(ka, kb, a, b, sb.app.peer_address, "off")
    assert (r.state, s.state) == ("DONE", "DONE") and s.path != "FUSED", s
    assert "same_host_route is 'off'" in s.route_note, s
    assert_pages_equal(pb, [7, 3, 9], pa, [4, 5, 6])


def _plan(address: str, boot_id: str, sb, make_pool, make_client, tid: str):  # type: ignore[no-untyped-def]
    pb = make_pool(LAYOUT)
    kb = make_client(sb)
    b = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
    kb.expect_delta(tid, b, prefix_pages=0, dst_page_indices=[1])
    with grpc.insecure_channel(address) as ch:
        return (
            peer_pb2_grpc.KVPeerStub(ch)
            .GetReceivePlan(
                peer_pb2.GetReceivePlanRequest(
                    transfer_id=tid,
                    sender_service_id="probe",
                    src_layout=LAYOUT.to_proto(),
                    wait_ms=1000,
                    sender_boot_id=boot_id,
                ),
                timeout=5,
            )
            .plans[0]
        )


def test_handles_only_for_the_same_boot_id_over_a_local_connection(
    make_server, make_pool, make_client
) -> None:
    """Pool handles go to a caller on this kernel that called over a Unix socket or loopback; never
    to another boot id, and not over a routable address even with our boot id."""
    sb = make_server(transport="loopback", tcp_address="0.0.0.0:0")
    port = sb.app.tcp_port
    mine = _plan(sb.app.peer_address, host.boot_id(), sb, make_pool, make_client, "h-local")
    assert len(mine.kv_handles) == 2 * LAYOUT.num_layers and not mine.same_host_refusal
    other = _plan(f"127.0.0.1:{port}", "another-boot-id", sb, make_pool, make_client, "h-other")
    assert not other.kv_handles and not other.same_host_refusal
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))
            ip = probe.getsockname()[0]
    except OSError:
        ip = ""
    if not ip or ip.startswith("127."):
        pytest.skip("this machine has no routable IPv4 address to call from")
    far = _plan(f"{ip}:{port}", host.boot_id(), sb, make_pool, make_client, "h-far")
    assert not far.kv_handles and "not a Unix socket or loopback" in far.same_host_refusal, far
