"""The Transfers stream: engines' calls and ended transfers on one held stream per session."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from kvservice_client import Client, Layout
from kvservice_client._errors import InvalidArgument, NotFound
from kvservice_client._proto import kvservice_pb2 as pb
from kvservice_client._proto import kvservice_pb2_grpc

from tests.support.pools import assert_pages_equal, fill_random

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=16, total_kv_heads=2, head_dim=8, dtype="float16")


@pytest.fixture
def node(make_server, make_pool, make_client):  # type: ignore[no-untyped-def]
    """One service, a sender and a receiver engine with random pools (no native lane: these
    tests are about the gRPC Transfers stream; tests/transfer/lane covers the lane)."""
    server = make_server(transport="loopback", lane=False)
    pa, pb_ = make_pool(LAYOUT), make_pool(LAYOUT)
    fill_random(pa, 1)
    fill_random(pb_, 2)
    ka, kb = make_client(server), make_client(server)
    a = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
    b = kb.register_buffers(LAYOUT, pb_.k_regions, pb_.v_regions).buffer_set_id
    return server, ka, kb, pa, pb_, a, b


def _no_watch(client: Client) -> None:
    def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("wait() opened a watch although the stream carried the transfer's end")

    client._statuses = refuse  # type: ignore[method-assign]


def test_wait_answers_from_the_stream_without_a_watch(node) -> None:  # type: ignore[no-untyped-def]
    """expect/send go on the stream and wait() returns the DONE it pushed, bytes in place."""
    server, ka, kb, pa, pb_, a, b = node
    _no_watch(ka)
    _no_watch(kb)
    for i in range(5):
        kb.expect_delta(f"s{i}", b, prefix_pages=0, dst_page_indices=[i, 8 + i])
        ka.send_delta(f"s{i}", a, src_page_indices=[15 - i, 3], peer_address=server.app.peer_address)
        (r,) = kb.wait(f"s{i}", timeout=10)
        (s,) = ka.wait(f"s{i}", timeout=10)
        assert (r.state, r.role, s.state, s.role) == ("DONE", "RECEIVER", "DONE", "SENDER")
        assert_pages_equal(pb_, [i, 8 + i], pa, [15 - i, 3])
    assert ka._tx is not None and not ka._tx.closed


def test_a_refused_call_raises_its_error_and_the_stream_stays(node) -> None:  # type: ignore[no-untyped-def]
    """A bad ExpectDelta on the stream raises the unary call's error, naming the field; later calls work."""
    server, ka, kb, pa, pb_, a, b = node
    with pytest.raises(InvalidArgument, match="dst_page_indices"):
        kb.expect_delta("bad", b, prefix_pages=0, dst_page_indices=[99])
    with pytest.raises(NotFound):
        kb.expect_delta("bad2", "no-such-buffer-set", prefix_pages=0, dst_page_indices=[1])
    tx = kb._tx
    kb.expect_delta("ok", b, prefix_pages=0, dst_page_indices=[1])
    ka.send_delta("ok", a, src_page_indices=[2], peer_address=server.app.peer_address)
    assert kb.wait("ok", timeout=10)[0].state == "DONE"
    assert kb._tx is tx and not tx.closed


def test_abort_on_the_stream_pushes_aborted_to_the_other_side(node) -> None:  # type: ignore[no-untyped-def]
    """An abort by the receiver ends its side ABORTED with the reason; its wait sees that end."""
    server, ka, kb, pa, pb_, a, b = node
    kb.expect_delta("ab", b, prefix_pages=0, dst_page_indices=[1, 2])
    (st,) = kb.abort("ab", reason="engine gave up")
    assert st.state == "ABORTED"
    (w,) = kb.wait("ab", timeout=5)
    assert w.state == "ABORTED" and "engine gave up" in w.error


def test_a_broken_stream_is_reopened_and_waits_fall_back_to_a_watch(node) -> None:  # type: ignore[no-untyped-def]
    """After the stream breaks, the next call opens a new one; a wait whose events were lost still ends."""
    server, ka, kb, pa, pb_, a, b = node
    kb.expect_delta("before", b, prefix_pages=0, dst_page_indices=[3])
    old = kb._tx
    old.close()  # the stream ends under the engine (as a broken connection would)
    ka.send_delta("before", a, src_page_indices=[4], peer_address=server.app.peer_address)
    assert kb.wait("before", timeout=10)[0].state == "DONE"  # through a watch: the book forgot
    kb.expect_delta("after", b, prefix_pages=0, dst_page_indices=[5])
    assert kb._tx is not old and not kb._tx.closed
    ka.send_delta("after", a, src_page_indices=[6], peer_address=server.app.peer_address)
    assert kb.wait("after", timeout=10)[0].state == "DONE"
    assert_pages_equal(pb_, [3, 5], pa, [4, 6])


def test_unary_calls_still_work_without_the_stream(make_server, make_pool) -> None:  # type: ignore[no-untyped-def]
    """transfer_stream=False: the same calls as unary RPCs and a watch per wait."""
    server = make_server(transport="loopback")
    pa, pb_ = make_pool(LAYOUT), make_pool(LAYOUT)
    fill_random(pa, 3)
    with (
        Client(server.address, transfer_stream=False) as ka,
        Client(server.address, transfer_stream=False) as kb,
    ):
        a = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
        b = kb.register_buffers(LAYOUT, pb_.k_regions, pb_.v_regions).buffer_set_id
        kb.expect_delta("u", b, prefix_pages=0, dst_page_indices=[7])
        ka.send_delta("u", a, src_page_indices=[8], peer_address=server.app.peer_address)
        assert kb.wait("u", timeout=10)[0].state == "DONE"
        assert kb._tx is None and ka._tx is None
    assert_pages_equal(pb_, [7], pa, [8])


def test_the_same_request_id_runs_once_across_stream_and_unary(node) -> None:  # type: ignore[no-untyped-def]
    """A SendDelta retried unary under the stream call's request id is answered, not run twice."""
    server, ka, kb, pa, pb_, a, b = node
    kb.expect_delta("rid", b, prefix_pages=0, dst_page_indices=[9])
    req = pb.SendDeltaRequest(
        transfer_id="rid",
        buffer_set_id=a,
        src_page_indices=[10],
        last_chunk=True,
        peer_address=server.app.peer_address,
    )
    tx = ka._transfer_stream()
    first = tx.call("send_delta", req, "retry-1", 10)
    again = ka._call("SendDelta", req, request_id="retry-1")
    assert first.status.transfer_id == again.status.transfer_id == "rid"
    assert kb.wait("rid", timeout=10)[0].state == "DONE"
    (s,) = ka.poll(["rid"])
    assert s.state == "DONE" and s.pages_sent == 1  # one chunk, not two


def test_call_id_zero_ends_the_stream_with_invalid_argument(node) -> None:  # type: ignore[no-untyped-def]
    """A call without an id cannot be answered: the stream ends INVALID_ARGUMENT naming call_id."""
    server, ka, kb, pa, pb_, a, b = node
    stub = kvservice_pb2_grpc.KVServiceStub(kb._channel)
    md = (("kvservice-session", kb.session_id),)
    call = stub.Transfers(
        iter([pb.TransferCall(call_id=0, abort=pb.AbortRequest(transfer_id="x"))]), metadata=md
    )
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "call_id" in err.value.details()


def test_many_transfers_in_flight_on_one_stream(node) -> None:  # type: ignore[no-untyped-def]
    """Sixteen transfers declared and sent back to back, then waited for: every one DONE, bytes right."""
    server, ka, kb, pa, pb_, a, b = node
    for i in range(16):
        kb.expect_delta(f"m{i}", b, prefix_pages=0, dst_page_indices=[i])
    for i in range(16):
        ka.send_delta(f"m{i}", a, src_page_indices=[15 - i], peer_address=server.app.peer_address)
    states = [kb.wait(f"m{i}", timeout=10)[0].state for i in range(16)]
    assert states == ["DONE"] * 16
    assert_pages_equal(pb_, list(range(16)), pa, list(np.arange(16)[::-1]))
