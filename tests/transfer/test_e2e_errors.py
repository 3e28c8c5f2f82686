"""End to end (loopback): bad SendDelta / ExpectDelta calls and deadlines.

Each bad call must fail with a clear error (the right code, the field named) and write nothing
into the receiver's pool; a rejected chunk leaves the transfer able to continue.
"""

from __future__ import annotations

import time

import pytest
from kvservice_client import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    Layout,
    NotFound,
    PermissionDenied,
)

from tests.support.poll import eventually
from tests.support.pools import assert_pages_equal, assert_unchanged, fill_random, snapshot
from tests.support.transfers import LAYOUT, link, one, staging_idle

SLACK_S = 1.0  # reaper tick, thread hops and a loaded 2-core box (a full-suite CI run took 0.93 s for 0.4 s)


# -- SendDelta -------------------------------------------------------------------------------
def test_send_to_undeclared_transfer_fails_within_deadline(pair, make_pool, make_client) -> None:
    """Receiver never declares: the sender ends FAILED (NOT_FOUND / DEADLINE_EXCEEDED) by its deadline."""
    ln = link(pair, make_pool, make_client)
    before = snapshot(ln.pb)
    t0 = time.monotonic()
    ln.ka.send_delta("ghost", ln.a, src_page_indices=[1, 2], peer_address=ln.peer, deadline_ms=300)
    s = one(ln.ka, "ghost", timeout=3)
    took = time.monotonic() - t0
    assert s.state == "FAILED" and s.error_code in ("NOT_FOUND", "DEADLINE_EXCEEDED"), s
    assert s.error, s
    assert took < 0.3 + SLACK_S, took
    assert_unchanged(ln.pb, before)
    assert ln.kb.poll(["ghost"]) == []


@pytest.mark.parametrize(
    "src,field,why",
    [
        ([1, 48], "src_page_indices", "outside"),
        ([-1], "src_page_indices", "outside"),
        ([3, 4, 3], "src_page_indices", "distinct"),
    ],
    ids=["past-end", "negative", "duplicate"],
)
def test_bad_src_pages_rejected_synchronously(pair, make_pool, make_client, src, field, why) -> None:
    """Out-of-range or duplicate source pages: INVALID_ARGUMENT naming the field; nothing moves."""
    ln = link(pair, make_pool, make_client)
    ln.kb.expect_delta("bad", ln.b, prefix_pages=0, dst_page_indices=[0, 1, 2])
    before = snapshot(ln.pb)
    with pytest.raises(InvalidArgument, match=field) as exc:
        ln.ka.send_delta("bad", ln.a, src_page_indices=src, peer_address=ln.peer)
    assert why in str(exc.value)
    assert ln.ka.poll(["bad"]) == []  # no sender record was created
    # the receiver's declaration is intact; a good send still completes
    ln.ka.send_delta("bad", ln.a, src_page_indices=[4, 5, 6], peer_address=ln.peer)
    assert one(ln.kb, "bad").state == "DONE"
    assert_pages_equal(ln.pb, [0, 1, 2], ln.pa, [4, 5, 6])
    assert_unchanged(ln.pb, before, except_pages=[0, 1, 2])


def test_layout_mismatch_fails_precondition_on_both_sides(pair, make_pool, make_client) -> None:
    """Sender head_dim 8, receiver head_dim 16: FAILED_PRECONDITION on both sides, nothing written."""
    sa, sb = pair
    other = Layout.mha(
        num_layers=2, page_size=4, num_pages=48, total_kv_heads=2, head_dim=16, dtype="float16"
    )
    pa, pb = make_pool(LAYOUT), make_pool(other)
    fill_random(pa, 1)
    fill_random(pb, 2)
    ka, kb = make_client(sa), make_client(sb)
    a = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
    b = kb.register_buffers(other, pb.k_regions, pb.v_regions).buffer_set_id
    before = snapshot(pb)
    kb.expect_delta("mm", b, prefix_pages=0, dst_page_indices=[1, 2], deadline_ms=5000)
    ka.send_delta("mm", a, src_page_indices=[3, 4], peer_address=sb.app.peer_address)
    r, s = one(kb, "mm", timeout=4), one(ka, "mm", timeout=4)
    for st in (r, s):
        assert (st.state, st.error_code) == ("FAILED", "FAILED_PRECONDITION"), st
        assert "head_dim" in st.error, st
    assert_unchanged(pb, before)


def _landed(ln: object, dst: list[int], src: list[int]) -> bool:
    try:
        assert_pages_equal(ln.pb, dst, ln.pa, src)  # type: ignore[attr-defined]
    except AssertionError:
        return False
    return True


def test_chunk_offset_gap_rejected_then_transfer_continues(pair, make_pool, make_client) -> None:
    """A gap between chunks (or an overlap) is INVALID_ARGUMENT naming chunk_offset; the transfer
    goes on. (A first chunk may start past 0: test_e2e_convert's prefix test.)"""
    ln = link(pair, make_pool, make_client)
    dst = [10, 11, 12, 13, 14, 15]
    before = snapshot(ln.pb)
    ln.kb.expect_delta("gap", ln.b, prefix_pages=0, dst_page_indices=dst)
    ln.ka.send_delta("gap", ln.a, src_page_indices=[0, 1, 2], peer_address=ln.peer, last_chunk=False)
    with pytest.raises(InvalidArgument, match="chunk_offset"):
        ln.ka.send_delta("gap", ln.a, src_page_indices=[4, 5], chunk_offset=4, peer_address=ln.peer)
    # (its bytes, not Poll's counts: a stream on the native lane is booked at its end)
    eventually(lambda: _landed(ln, dst[:3], [0, 1, 2]), 5, "the first chunk landed")
    mid = snapshot(ln.pb)
    with pytest.raises(InvalidArgument, match="chunk_offset"):  # overlapping the previous chunk
        ln.ka.send_delta("gap", ln.a, src_page_indices=[2, 3], chunk_offset=2, peer_address=ln.peer)
    assert_unchanged(ln.pb, mid)
    ln.ka.send_delta("gap", ln.a, src_page_indices=[3, 4, 5], chunk_offset=3, peer_address=ln.peer)
    assert (one(ln.kb, "gap").state, one(ln.ka, "gap").state) == ("DONE", "DONE")
    assert_pages_equal(ln.pb, dst, ln.pa, [0, 1, 2, 3, 4, 5])
    assert_unchanged(ln.pb, before, except_pages=dst)


def test_peer_address_change_mid_transfer_rejected(pair, make_pool, make_client, make_server) -> None:
    """A later chunk naming another receiver service is INVALID_ARGUMENT naming peer_address."""
    ln = link(pair, make_pool, make_client)
    third = make_server(transport="loopback")
    ln.kb.expect_delta("pa", ln.b, prefix_pages=0, dst_page_indices=[7, 8, 9, 20])
    ln.ka.send_delta("pa", ln.a, src_page_indices=[0, 1], peer_address=ln.peer, last_chunk=False)
    with pytest.raises(InvalidArgument, match="peer_address"):
        ln.ka.send_delta(
            "pa", ln.a, src_page_indices=[2, 3], chunk_offset=2, peer_address=third.app.peer_address
        )
    ln.ka.send_delta("pa", ln.a, src_page_indices=[2, 3], chunk_offset=2, peer_address=ln.peer)
    assert one(ln.kb, "pa").state == "DONE"
    assert_pages_equal(ln.pb, [7, 8, 9, 20], ln.pa, [0, 1, 2, 3])


def test_chunk_overrunning_declared_pages_fails_both_sides(pair, make_pool, make_client) -> None:
    """Sender holds more pages than the receiver made room for: FAILED_PRECONDITION, nothing written."""
    ln = link(pair, make_pool, make_client)
    before = snapshot(ln.pb)
    ln.kb.expect_delta("over", ln.b, prefix_pages=1, dst_page_indices=[5, 6], deadline_ms=5000)
    ln.ka.send_delta("over", ln.a, src_page_indices=[0, 1, 2, 3], peer_address=ln.peer)
    r, s = one(ln.kb, "over", timeout=4), one(ln.ka, "over", timeout=4)
    assert (s.state, s.error_code) == ("FAILED", "FAILED_PRECONDITION"), s
    assert "src_page_indices" in s.error
    assert r.state == "FAILED" and r.error_code == "FAILED_PRECONDITION", r
    assert_unchanged(ln.pb, before)


def test_send_with_other_sessions_buffer_set_denied(pair, make_pool, make_client) -> None:
    """SendDelta naming a buffer set another client registered: PERMISSION_DENIED, nothing moves."""
    ln = link(pair, make_pool, make_client)
    intruder = make_client(pair[0])
    ln.kb.expect_delta("steal", ln.b, prefix_pages=0, dst_page_indices=[1], deadline_ms=1000)
    with pytest.raises(PermissionDenied):
        intruder.send_delta("steal", ln.a, src_page_indices=[0], peer_address=ln.peer)
    assert intruder.poll() == [] and ln.ka.poll(["steal"]) == []


# -- ExpectDelta -----------------------------------------------------------------------------
def test_duplicate_declaration_already_exists(pair, make_pool, make_client) -> None:
    """A second ExpectDelta of a live transfer id: ALREADY_EXISTS; the first declaration still works."""
    ln = link(pair, make_pool, make_client)
    ln.kb.expect_delta("dup", ln.b, prefix_pages=0, dst_page_indices=[1, 2])
    with pytest.raises(AlreadyExists, match="dup"):
        ln.kb.expect_delta("dup", ln.b, prefix_pages=0, dst_page_indices=[3, 4])
    ln.ka.send_delta("dup", ln.a, src_page_indices=[8, 9], peer_address=ln.peer)
    assert one(ln.kb, "dup").state == "DONE"
    assert_pages_equal(ln.pb, [1, 2], ln.pa, [8, 9])


@pytest.mark.parametrize("dst,why", [([0, 48], "outside"), ([-2], "outside"), ([5, 5], "distinct")])
def test_bad_dst_pages_rejected(pair, make_pool, make_client, dst, why) -> None:
    """Bad destination pages: INVALID_ARGUMENT naming dst_page_indices; no declaration made."""
    ln = link(pair, make_pool, make_client)
    with pytest.raises(InvalidArgument, match="dst_page_indices") as exc:
        ln.kb.expect_delta("bd", ln.b, prefix_pages=0, dst_page_indices=dst)
    assert why in str(exc.value)
    assert ln.kb.poll(["bd"]) == []


def test_expect_into_other_sessions_buffer_set_denied(pair, make_pool, make_client) -> None:
    """ExpectDelta into a buffer set another client registered: PERMISSION_DENIED; unknown id: NOT_FOUND."""
    ln = link(pair, make_pool, make_client)
    intruder = make_client(pair[1])
    with pytest.raises(PermissionDenied):
        intruder.expect_delta("x", ln.b, prefix_pages=0, dst_page_indices=[1])
    with pytest.raises(NotFound, match="buffer"):
        intruder.expect_delta("x", "bs-0000000000000000", prefix_pages=0, dst_page_indices=[1])
    assert ln.kb.poll(["x"]) == [] and intruder.poll() == []


@pytest.mark.parametrize("landing", [False, True], ids=["pages", "landing"])
def test_a_refused_expect_names_none_of_another_clients_objects(
    pair, make_pool, make_client, landing
) -> None:
    """ExpectDelta (or a landing) reusing a transfer id another engine declared: FAILED_PRECONDITION
    that names the id only, never the other engine's buffer set or session; the
    other engine's transfer then completes byte-exact."""
    ln = link(pair, make_pool, make_client)
    intruder, pool = make_client(pair[1]), make_pool(LAYOUT)
    own = intruder.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
    ln.kb.expect_delta("taken", ln.b, prefix_pages=0, dst_page_indices=[1, 2])
    before = snapshot(ln.pb)
    with pytest.raises(FailedPrecondition, match="in use by another client") as exc:
        if landing:
            intruder.expect_landing("taken", own, pages=2)
        else:
            intruder.expect_delta("taken", own, prefix_pages=0, dst_page_indices=[1, 2])
    msg = str(exc.value)
    assert "taken" in msg and ln.b not in msg and ln.kb.session_id not in msg, msg
    assert intruder.poll(["taken"]) == []
    assert_unchanged(ln.pb, before)
    ln.ka.send_delta("taken", ln.a, src_page_indices=[8, 9], peer_address=ln.peer)
    assert one(ln.kb, "taken").state == "DONE"
    assert_pages_equal(ln.pb, [1, 2], ln.pa, [8, 9])


def test_send_after_transfer_ended_rejected(pair, make_pool, make_client) -> None:
    """A chunk after the last one: FAILED_PRECONDITION (or a fresh transfer), never a stray write."""
    ln = link(pair, make_pool, make_client)
    ln.kb.expect_delta("fin", ln.b, prefix_pages=0, dst_page_indices=[3])
    ln.ka.send_delta("fin", ln.a, src_page_indices=[0], peer_address=ln.peer)
    assert one(ln.kb, "fin").state == "DONE"
    after = snapshot(ln.pb)
    with pytest.raises(InvalidArgument, match="chunk_offset"):
        ln.ka.send_delta("fin", ln.a, src_page_indices=[1], chunk_offset=1, peer_address=ln.peer)
    assert_unchanged(ln.pb, after)


# -- deadlines -------------------------------------------------------------------------------
def test_receiver_deadline_when_sender_never_sends(pair, make_pool, make_client) -> None:
    """Receiver declares with deadline 300 ms and no sender comes: FAILED DEADLINE_EXCEEDED in time."""
    ln = link(pair, make_pool, make_client)
    before = snapshot(ln.pb)
    t0 = time.monotonic()
    ln.kb.expect_delta("late", ln.b, prefix_pages=0, dst_page_indices=[1, 2], deadline_ms=300)
    r = one(ln.kb, "late", timeout=3)
    took = time.monotonic() - t0
    assert (r.state, r.error_code) == ("FAILED", "DEADLINE_EXCEEDED"), r
    assert r.error
    assert 0.25 < took < 0.3 + SLACK_S, took
    assert_unchanged(ln.pb, before)


def test_sender_deadline_when_receiver_never_declares(pair, make_pool, make_client) -> None:
    """Sender's deadline 300 ms passes waiting for the plan: FAILED DEADLINE_EXCEEDED in time."""
    ln = link(pair, make_pool, make_client)
    t0 = time.monotonic()
    ln.ka.send_delta("nodecl", ln.a, src_page_indices=[1], peer_address=ln.peer, deadline_ms=300)
    s = one(ln.ka, "nodecl", timeout=3)
    took = time.monotonic() - t0
    assert (s.state, s.error_code) == ("FAILED", "DEADLINE_EXCEEDED"), s
    assert took < 0.3 + SLACK_S, took


@pytest.mark.parametrize("path", ["direct", "packed"])
def test_deadline_mid_transfer_fails_both_sides(pair, make_pool, make_client, path) -> None:
    """First chunk lands, the last never comes: both sides FAILED DEADLINE_EXCEEDED, staging freed."""
    ln = link(pair, make_pool, make_client)
    t0 = time.monotonic()
    # 1 s: the first chunk must land before it (a full-suite CI run on the 2-core VM once needed
    # more than 0.4 s for the two-service packed route's first chunk)
    ln.kb.expect_delta("stall", ln.b, prefix_pages=0, dst_page_indices=[1, 2, 3, 4], deadline_ms=1000)
    ln.ka.send_delta(
        "stall",
        ln.a,
        src_page_indices=[5, 6],
        peer_address=ln.peer,
        last_chunk=False,
        deadline_ms=1000,
        path=path,
    )
    r, s = one(ln.kb, "stall", timeout=4), one(ln.ka, "stall", timeout=4)
    took = time.monotonic() - t0
    for st in (r, s):
        assert (st.state, st.error_code) == ("FAILED", "DEADLINE_EXCEEDED"), st
    assert took < 1.0 + SLACK_S, took
    assert_pages_equal(ln.pb, [1, 2], ln.pa, [5, 6])
    # the receiver's peer-channel credits go back when the channel idles (1 s)
    eventually(lambda: staging_idle(pair[0]) and staging_idle(pair[1]), 3, "staging released")
