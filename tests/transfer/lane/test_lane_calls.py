"""ExpectDelta on the engine's lane (lane_wire CALL): once the session's Transfers stream answered
a call, the SDK's ExpectDelta goes over the lane with no gRPC; it declares the same transfer, its
errors are the gRPC call's (code and field), a request id runs once across the lane and gRPC, and
a malformed or unknown CALL changes nothing."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from kvservice_client import AsyncClient, lane_wire
from kvservice_client._errors import InvalidArgument, NotFound
from kvservice_client._proto import kvservice_pb2 as pb

from tests.support.lane import LAYOUT, Engines
from tests.support.poll import eventually


@pytest.fixture
def eng(make_server: Any) -> Iterator[Engines]:
    e = Engines(make_server(transport="loopback"))
    yield e
    e.close()


def _lane(eng: Engines) -> Any:
    eng.kb.expect_delta("first", eng.b, prefix_pages=0, dst_page_indices=[0])  # on the stream
    eng.kb.abort("first")
    lane = eng.kb._lane.lane
    assert lane is not None and "expect_delta" in lane.calls_served
    return lane


def test_expect_delta_goes_over_the_lane_and_the_transfer_lands(eng: Engines) -> None:
    lane = _lane(eng)
    before = eng.snapshot()
    st = eng.kb.expect_delta("t-call", eng.b, prefix_pages=1, dst_page_indices=[5, 6])
    assert lane.calls == 1 and st.state == "PENDING" and st.role == "RECEIVER", st
    eng.ka.send_delta("t-call", eng.a, src_page_indices=[9, 3, 4], peer_address=eng.peer)
    (r,) = eng.kb.wait("t-call", timeout=10)
    assert r.state == "DONE" and r.pages_sent == 2 and r.pages_skipped == 1, r
    assert eng.pages(eng.pb, [5, 6]) == eng.pages(eng.pa, [3, 4])
    assert eng.changed_pages(before) <= {5, 6}


def test_a_bad_expect_on_the_lane_is_the_grpc_error_and_declares_nothing(eng: Engines) -> None:
    lane = _lane(eng)
    with pytest.raises(NotFound, match="buffer_set_id"):
        eng.kb.expect_delta("t-bad", "bs-nope", prefix_pages=0, dst_page_indices=[1])
    with pytest.raises(InvalidArgument, match="dst_page_indices"):
        eng.kb.expect_delta("t-bad", eng.b, prefix_pages=0, dst_page_indices=[10_000])
    assert lane.calls == 0
    assert eng.server.node.transfers.table.live() == []


def test_a_request_id_runs_once_across_the_lane_and_grpc(eng: Engines) -> None:
    """The SDK's fallback after a lost REPLY makes the same request again: it is answered, not run twice."""
    lane = _lane(eng)
    req = pb.ExpectDeltaRequest(
        transfer_id="t-rid", buffer_set_id=eng.b, prefix_pages=0, dst_page_indices=[2]
    )
    first = pb.ExpectDeltaResponse.FromString(
        lane.call(lane_wire.CALL_EXPECT, "rid-1", req.SerializeToString(), 5)
    )
    again = eng.kb._transfer_call("expect_delta", "ExpectDelta", req, "rid-1")
    assert again.status.transfer_id == "t-rid" and again.status == first.status  # the same answer, replayed
    with pytest.raises(Exception, match="t-rid"):  # a new request for the same id is refused
        eng.kb.expect_delta("t-rid", eng.b, prefix_pages=0, dst_page_indices=[2])


def test_an_unknown_call_is_invalid_and_a_malformed_one_drops_only_its_connection(eng: Engines) -> None:
    lane = _lane(eng)
    with pytest.raises(InvalidArgument, match="kind"):
        lane.call(99, "r", b"", 5)
    with pytest.raises(InvalidArgument, match="request"):
        lane.call(lane_wire.CALL_EXPECT, "r2", b"\xff\xff\xff", 5)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # a second lane of this session
    raw.connect(eng.kb._lane.path)
    raw.send(lane_wire.hello(eng.kb.session_id))
    assert lane_wire.parse_welcome(raw.recv(65536))["ok"]
    raw.send(struct.pack("<5I", lane_wire.MSG_CALL, 1, 1, 0, 1000) + b"short")  # lengths that lie
    raw.settimeout(5)
    assert raw.recv(65536) == b"", "the service closed the malformed lane"
    raw.close()
    st = eng.kb.expect_delta(
        "t-after", eng.b, prefix_pages=0, dst_page_indices=[3]
    )  # the SDK's lane still works
    assert st.state == "PENDING" and lane.calls == 1


def test_a_service_without_calls_gets_expect_delta_over_grpc(eng: Engines) -> None:
    lane = _lane(eng)
    eng.lane.native.set_calls(False)  # as a service that answers none: every CALL is fallback
    body = pb.ExpectDeltaRequest(
        transfer_id="t-fb", buffer_set_id=eng.b, prefix_pages=0, dst_page_indices=[4]
    )
    assert lane.call(lane_wire.CALL_EXPECT, "rid-fb", body.SerializeToString(), 5) is None
    st = eng.kb.expect_delta("t-fb2", eng.b, prefix_pages=0, dst_page_indices=[4])
    assert st.state == "PENDING" and lane.calls == 0
    eventually(lambda: eng.server.node.transfers.table.live() != [], 5, "declared over gRPC")


def test_the_async_client_declares_over_the_lane_without_blocking_its_loop(eng: Engines) -> None:
    """AsyncClient (both adapters' client) sends ExpectDelta as a CALL and awaits the REPLY (the
    loop is free meanwhile); a bad call is the gRPC error; a CALL answered fallback is made over
    gRPC."""

    async def main() -> None:
        kv = AsyncClient(eng.server.address, client_name="decode-async")
        try:
            reg = await kv.register_buffers(LAYOUT, eng.pb.k_regions, eng.pb.v_regions)
            bs = reg.buffer_set_id
            st = await kv.expect_delta("t-async", bs, prefix_pages=0, dst_page_indices=[7, 8])
            lane = kv._lane.lane
            assert lane is not None and lane.calls == 1, "not declared over the lane"
            assert st.state == "PENDING" and st.role == "RECEIVER", st
            req = pb.ExpectDeltaRequest(transfer_id="t-await", buffer_set_id=bs, dst_page_indices=[3])
            call = asyncio.create_task(
                lane.call_async(lane_wire.CALL_EXPECT, "rid-a", req.SerializeToString(), 5)
            )
            await asyncio.sleep(
                0
            )  # the call's first step sent the CALL; its REPLY is awaited, not waited for
            assert not call.done(), "call_async held the loop until its REPLY"
            assert pb.ExpectDeltaResponse.FromString(await call).status.transfer_id == "t-await"
            eng.ka.send_delta("t-async", eng.a, src_page_indices=[1, 2], peer_address=eng.peer)
            async for s in kv.watch(["t-async"], include_current=True):
                if s.state in ("DONE", "FAILED", "ABORTED"):
                    assert s.state == "DONE" and s.pages_sent == 2, s
                    break
            with pytest.raises(InvalidArgument, match="dst_page_indices"):
                await kv.expect_delta("t-bad", bs, prefix_pages=0, dst_page_indices=[10_000])
            assert lane.calls == 2
            eng.lane.native.set_calls(False)
            st = await kv.expect_delta("t-grpc", bs, prefix_pages=0, dst_page_indices=[9])
            assert st.state == "PENDING" and lane.calls == 2, "the fallback did not go over gRPC"
            eng.lane.native.set_calls(True)
        finally:
            await kv.close()

    before = eng.snapshot()
    asyncio.run(main())
    assert eng.changed_pages(before) == {7, 8}  # eng.pb is the async engine's pool too
    assert eng.pages(eng.pb, [7, 8]) == eng.pages(eng.pa, [1, 2])
