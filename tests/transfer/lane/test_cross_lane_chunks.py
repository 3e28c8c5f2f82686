"""Chunked transfers with aux rows across services on the cross-node lane (CPU: NIXL over UCX on
DRAM, shm pools): under mutual TLS, token and insecure peers, a transfer sent in chunks (aux rows
on the last) goes from the sender's lane into the receiver's and lands byte exact; a bad later
chunk is INVALID_ARGUMENT and changes nothing; a short last chunk, the receiver's Abort, its
deadline, the sender's Abort or its session ending mid-stream end the transfer on both sides."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvservice_client._errors import FailedPrecondition, InvalidArgument

from tests.support.nodes import LAYOUT, Nodes
from tests.support.poll import eventually

pytest.importorskip("nixl")
AUX = {"meta": (48, 16)}


@pytest.fixture(params=["mtls", "token", "insecure"])
def nodes(request: Any, make_server: Any, tmp_path: Any) -> Iterator[Nodes]:
    n = Nodes(make_server, str(tmp_path), cross_lane=True, auth=request.param, aux=AUX)
    try:
        r, _ = n.move("warm", [0], [0])  # opens A's channel to B: offers travel on it
        assert r.state == "DONE", r
        yield n
    finally:
        n.close()


def _expect(n: Nodes, tid: str, dst: list[int], prefix: int = 0, **kw: Any) -> None:
    n.b.kv.expect_delta(
        tid, n.b.bs, prefix_pages=prefix, dst_page_indices=dst, sender_address=n.sa.app.peer_address, **kw
    )
    # the offer travels on the sender's channel: until service A's lane holds it (this one: an
    # earlier transfer's may still be on the lane)
    eventually(lambda: n.sa.app.lane.result().book.cross.tx.holds_offer(tid), 10, f"offer of {tid}")


def _send(n: Nodes, tid: str, src: list[int], offset: int, last: bool, aux: Any = None) -> None:
    n.a.kv.send_delta(
        tid, n.a.bs, src_page_indices=src, chunk_offset=offset, last_chunk=last, aux=aux, peer_address=n.peer
    )


def _settled(n: Nodes) -> None:
    for s in (n.sa, n.sb):
        eventually(lambda s=s: s.app.node.transfers.table.live() == [], 10, "nothing live")
        eventually(lambda s=s: s.app.lane.result().native.cross_count() == 0, 10, "nothing on the lane")


@pytest.mark.parametrize("cuts", [[2], [1, 2, 3, 4, 5]], ids=["2-chunks", "6-chunks"])
def test_chunks_with_aux_rows_take_the_cross_node_lane_byte_exact(nodes: Nodes, cuts: list[int]) -> None:
    n = nodes
    src, dst = [3, 9, 14, 20, 27, 5, 6], [30, 1, 7, 8, 12]
    before = n.b.snapshot()
    _expect(n, "x-ch", dst, prefix=2, aux={"meta": [0, 15]})
    bounds = [0, *cuts, len(src)]
    lane_before = n.a.kv.lane_sent
    for i in range(len(bounds) - 1):
        last = i == len(bounds) - 2
        _send(n, "x-ch", src[bounds[i] : bounds[i + 1]], bounds[i], last, {"meta": [2, 5]} if last else None)
    (r,) = n.b.kv.wait("x-ch", timeout=30)
    (s,) = n.a.kv.wait("x-ch", timeout=30)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == s.route_note == "cross-node lane", (r, s)
    assert n.a.kv.lane_sent - lane_before == len(cuts) + 1, "every chunk went over the lane"
    assert n.b.pages(dst) == n.a.pages(src[2:])
    assert n.b.rows("meta", [0, 15]) == n.a.rows("meta", [2, 5])
    assert n.b.changed(before) <= set(dst)
    for kv in (n.b.kv, n.a.kv):  # the sender's record booked chunk by chunk adds up the same
        polled = eventually(lambda kv=kv: (p := kv.poll(["x-ch"])[0]).state == "DONE" and p, 10, "booked")
        assert (polled.state, polled.pages_sent, polled.pages_skipped) == ("DONE", 5, 2), polled
        assert polled.bytes_sent == 5 * LAYOUT.page_bytes_all_layers + 2 * 48, polled
    _settled(n)


def test_a_last_chunk_of_aux_rows_only_and_a_first_chunk_in_the_prefix(nodes: Nodes) -> None:
    n = nodes
    src, dst = [11, 12, 13], [4, 5]
    _expect(n, "x-aux", dst, prefix=2, aux={"meta": [3]})
    _send(n, "x-aux", src, 1, False)  # from page 1 of the transfer: one prefix page
    _send(n, "x-aux", [], 4, True, {"meta": [9]})
    (r,) = n.b.kv.wait("x-aux", timeout=30)
    assert r.state == "DONE" and r.route_note == "cross-node lane", r
    assert n.b.pages(dst) == n.a.pages(src[1:])
    assert n.b.rows("meta", [3]) == n.a.rows("meta", [9])
    for kv in (n.b.kv, n.a.kv):  # both sides count the aux row's bytes and the one prefix page sent
        # (the END comes first, the record is booked after it)
        st = eventually(lambda kv=kv: (p := kv.poll(["x-aux"])[0]).state == "DONE" and p, 10, "booked")
        assert (st.pages_sent, st.pages_skipped) == (2, 1), st
        assert st.bytes_sent == 2 * LAYOUT.page_bytes_all_layers + 48, st
    _settled(n)


def test_a_bad_later_chunk_is_invalid_and_the_transfer_goes_on(nodes: Nodes) -> None:
    n = nodes
    dst = [1, 2, 3, 4]
    _expect(n, "x-bad", dst, aux={"meta": [3]})
    _send(n, "x-bad", [5, 6], 0, False)
    eventually(lambda: n.b.pages([1, 2]) == n.a.pages([5, 6]), 10, "the first chunk landed")
    mid = n.b.snapshot()
    for kw, match in [
        ({"src": [8], "offset": 3, "last": False}, "chunk_offset: 3: chunks must be contiguous"),
        ({"src": [8, 9, 10], "offset": 2, "last": True}, "src_page_indices: the chunk ends at page 5"),
        ({"src": [8, 8], "offset": 2, "last": True}, "src_page_indices: source pages repeat"),
        ({"src": [8, 9], "offset": 2, "last": True, "aux": {"nope": [1]}}, "no aux region named 'nope'"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            _send(n, "x-bad", **kw)
        assert n.b.changed(mid) == set(), kw
    _send(n, "x-bad", [8, 9], 2, True, {"meta": [1]})
    (r,) = n.b.kv.wait("x-bad", timeout=30)
    assert r.state == "DONE" and r.route_note == "cross-node lane", r
    assert n.b.pages(dst) == n.a.pages([5, 6, 8, 9])
    _settled(n)


def test_receiver_side_aux_mismatch_and_a_short_last_chunk_fail_both_sides(nodes: Nodes) -> None:
    n = nodes
    _expect(n, "x-mis", [1, 2], aux={"meta": [3]})
    _send(n, "x-mis", [5, 6], 0, True, {"meta": [1, 2]})  # two rows for one declared
    (r,) = n.b.kv.wait("x-mis", timeout=30)
    (s,) = n.a.kv.wait("x-mis", timeout=30)
    assert r.state == s.state == "FAILED" and "receiver declared 1" in r.error, (r, s)
    _expect(n, "x-short", [1, 2, 3])
    _send(n, "x-short", [5], 0, False)
    with pytest.raises(FailedPrecondition, match="1 of 3 delta pages unsent"):
        _send(n, "x-short", [6], 1, True)
    (r,) = n.b.kv.wait("x-short", timeout=30)
    (s,) = n.a.kv.wait("x-short", timeout=30)
    assert r.state == s.state == "FAILED", (r, s)
    _settled(n)


def test_the_receivers_abort_mid_stream_ends_the_sender_no_byte_after(nodes: Nodes) -> None:
    n = nodes
    _expect(n, "x-ab", [1, 2, 3])
    _send(n, "x-ab", [5], 0, False)
    eventually(lambda: n.b.pages([1]) == n.a.pages([5]), 10, "the first chunk landed")
    after = n.b.snapshot()
    t0 = time.monotonic()
    n.b.kv.abort("x-ab")
    (s,) = n.a.kv.wait("x-ab", timeout=30)
    assert s.state == "FAILED" and time.monotonic() - t0 < 5, s
    with pytest.raises(FailedPrecondition):
        _send(n, "x-ab", [6, 7], 1, True)
    assert n.b.changed(after) == set()
    _settled(n)


def test_the_senders_session_ending_mid_stream_fails_the_receiver(nodes: Nodes) -> None:
    n = nodes
    _expect(n, "x-gone", [1, 2], deadline_ms=20_000)
    _send(n, "x-gone", [5], 0, False)
    t0 = time.monotonic()
    n.a.kv.close()
    (r,) = n.b.kv.wait("x-gone", timeout=30)
    assert r.state == "FAILED" and time.monotonic() - t0 < 10, r
    n.a.kv = type(n.b.kv)(n.sa.address, client_name="prefill-again")  # (close() closes it again)


def test_the_senders_abort_mid_stream_ends_both_sides_at_once(nodes: Nodes) -> None:
    """The sending engine's Abort between chunks: its side ends ABORTED (Poll says so when Abort
    returns), the receiver hears it at once, a later chunk is refused and writes nothing."""
    n = nodes
    _expect(n, "x-sab", [1, 2, 3], deadline_ms=30_000)
    _send(n, "x-sab", [5], 0, False)
    eventually(lambda: n.b.pages([1]) == n.a.pages([5]), 10, "the first chunk landed")
    # (the chunk lands, then the sender's record books it)
    (mid,) = eventually(lambda: n.a.kv.poll(["x-sab"]), 10, "the sender's record")
    assert mid.state in ("QUEUED", "TRANSFERRING") and mid.route_note == "cross-node lane", mid
    after = n.b.snapshot()
    t0 = time.monotonic()
    (st,) = n.a.kv.abort("x-sab", reason="prefill cancelled")
    assert st.state == "ABORTED" and "prefill cancelled" in st.error, st
    (r,) = n.b.kv.wait("x-sab", timeout=30)
    assert r.state in ("FAILED", "ABORTED") and time.monotonic() - t0 < 5, r
    with pytest.raises((FailedPrecondition, InvalidArgument)):
        _send(n, "x-sab", [6, 7], 1, True)
    assert n.b.changed(after) == set()
    _settled(n)


def test_the_senders_buffer_set_unregistered_mid_stream_fails_both_sides(nodes: Nodes) -> None:
    """Unregistering the sending buffer set between chunks ends the stream at once (not at its
    deadline): both sides FAILED, the receiver's pages past the first chunk untouched."""
    n = nodes
    _expect(n, "x-unreg", [1, 2, 3], deadline_ms=30_000)
    _send(n, "x-unreg", [5], 0, False)
    eventually(lambda: n.b.pages([1]) == n.a.pages([5]), 10, "the first chunk landed")
    after = n.b.snapshot()
    t0 = time.monotonic()
    n.a.kv.unregister_buffers(n.a.bs)
    (r,) = n.b.kv.wait("x-unreg", timeout=30)
    assert r.state == "FAILED" and time.monotonic() - t0 < 5, r
    (s,) = eventually(lambda: [p for p in n.a.kv.poll(["x-unreg"]) if p.state == "FAILED"], 10, "sender")
    assert "unregistered" in s.error, s
    assert n.b.changed(after) == set()
    n.a.bs = n.a.kv.register_buffers(
        LAYOUT, n.a.pool.k_regions, n.a.pool.v_regions, aux=n.a.pool.aux_specs
    ).buffer_set_id
    _settled(n)
