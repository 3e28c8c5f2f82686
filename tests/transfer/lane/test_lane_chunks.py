"""Chunked transfers and aux rows on the native lane (CPU: shm pools, memcpy): a transfer sent in
any number of chunks, with aux rows, starting inside the receiver's prefix, takes the lane (the
END says so) and lands byte exact; a chunk the lane cannot take after it took the transfer is
refused with the reason and the transfer ends FAILED on both sides; the receiver's Abort, its
deadline or the sender's session ending mid-stream end it, no byte after, nothing left armed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import Client
from kvservice_client._errors import FailedPrecondition, InvalidArgument

from tests.support.lane import LAYOUT, Engines
from tests.support.poll import eventually

AUX = {"meta": (48, 16), "state": (8, 8)}


@pytest.fixture
def eng(make_server: Any) -> Iterator[Engines]:
    e = Engines(make_server(transport="loopback"), aux=AUX)
    yield e
    e.close()


def _clean(eng: Engines) -> None:
    """Nothing of the lane or the transfer table stays behind."""
    eventually(lambda: eng.lane.book.n.armed_count() == 0, 10, "nothing armed")
    eventually(lambda: eng.server.node.transfers.table.live() == [], 10, "nothing live")


def _send_chunks(
    eng: Engines, tid: str, src: list[int], cuts: list[int], aux: dict[str, list[int]], start: int = 0
) -> None:
    """``src`` from transfer page ``start`` on, in chunks ending at ``cuts`` (and the end); aux
    rows on the last."""
    bounds = [0, *cuts, len(src)]
    for i in range(len(bounds) - 1):
        last = i == len(bounds) - 2
        st = eng.ka.send_delta(
            tid,
            eng.a,
            src_page_indices=src[bounds[i] : bounds[i + 1]],
            chunk_offset=start + bounds[i],
            last_chunk=last,
            aux=aux if last else None,
            peer_address=eng.peer,
        )
        assert st.path == "FUSED" and st.state in ("QUEUED", "TRANSFERRING"), st


@pytest.mark.parametrize(
    "cuts",
    [[3], [1, 2, 3, 4, 5, 6, 7], [2, 2, 5]],  # 2 chunks; 8 chunks of one page; an empty chunk
    ids=["2-chunks", "8-chunks", "empty-chunk"],
)
def test_a_chunked_transfer_with_aux_rows_takes_the_lane_byte_exact(eng: Engines, cuts: list[int]) -> None:
    src, dst = [3, 9, 14, 20, 27, 5, 6, 31], [30, 1, 7, 8, 12, 13]
    aux_src, aux_dst = {"meta": [2, 5], "state": [7]}, {"meta": [0, 15], "state": [3]}
    before, before_aux = eng.snapshot(), eng.aux_snapshot()
    eng.kb.expect_delta("t-ch", eng.b, prefix_pages=2, dst_page_indices=dst, aux=aux_dst)
    _send_chunks(eng, "t-ch", src, cuts, aux_src)
    (r,) = eng.kb.wait("t-ch", timeout=10)
    (s,) = eng.ka.wait("t-ch", timeout=10)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == "lane" and s.route_note == "lane", "the END came over the lane"
    assert (r.pages_sent, r.pages_skipped) == (6, 2)
    assert r.bytes_sent == 6 * LAYOUT.page_bytes_all_layers + 2 * 48 + 8
    assert eng.pages(eng.pb, dst) == eng.pages(eng.pa, src[2:])
    assert eng.rows(eng.pb, "meta", [0, 15]) == eng.rows(eng.pa, "meta", [2, 5])
    assert eng.rows(eng.pb, "state", [3]) == eng.rows(eng.pa, "state", [7])
    assert eng.changed_pages(before) <= set(dst)
    changed = eng.changed_rows(before_aux)
    assert changed["meta"] <= {0, 15} and changed["state"] <= {3}
    # Python's bookkeeping: both records DONE with the lane's counts, the lane's entry gone
    eventually(lambda: eng.lane.book.sent == 1, 10, "booked")
    polled = {x.role: x for x in eng.kb.poll(["t-ch"]) + eng.ka.poll(["t-ch"])}
    assert polled["RECEIVER"].state == polled["SENDER"].state == "DONE"
    assert polled["RECEIVER"].pages_sent == 6 and polled["RECEIVER"].pages_skipped == 2
    assert eng.ka.lane_sent == len(cuts) + 1, "every chunk went over the lane"
    _clean(eng)


def test_a_first_chunk_inside_the_prefix_takes_the_lane(eng: Engines) -> None:
    """A sender that knows the receiver's prefix starts there (SGLang's decode_prefix_len)."""
    src, dst = [11, 12, 13, 14], [4, 5, 6]
    eng.kb.expect_delta("t-pre", eng.b, prefix_pages=3, dst_page_indices=dst)
    _send_chunks(eng, "t-pre", src, [2], {}, start=2)  # pages 2.. of the transfer: 1 skipped
    (r,) = eng.kb.wait("t-pre", timeout=10)
    assert r.state == "DONE" and r.route_note == "lane", r
    assert (r.pages_sent, r.pages_skipped) == (3, 1)
    assert eng.pages(eng.pb, dst) == eng.pages(eng.pa, src[1:])
    _clean(eng)


def test_a_bad_later_chunk_is_invalid_changes_nothing_and_the_transfer_goes_on(eng: Engines) -> None:
    """As over gRPC: a gap, an overlap, pages past the delta, a bad source page or aux rows the
    receiver did not declare are INVALID_ARGUMENT naming the field; nothing lands; the right
    chunk then completes the transfer on the lane."""
    dst = [1, 2, 3, 4]
    before, before_aux = eng.snapshot(), eng.aux_snapshot()
    eng.kb.expect_delta("t-bad", eng.b, prefix_pages=0, dst_page_indices=dst, aux={"meta": [3]})
    eng.ka.send_delta("t-bad", eng.a, src_page_indices=[5, 6], last_chunk=False, peer_address=eng.peer)
    # a host copy's REPLY comes before its copy: the first chunk's pages land, then the snapshot
    eventually(lambda: eng.pages(eng.pb, dst[:2]) == eng.pages(eng.pa, [5, 6]), 10, "the first chunk landed")
    mid = eng.snapshot()
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {"src_page_indices": [8], "chunk_offset": 3},
            "chunk_offset: 3: chunks must be contiguous and in order",
        ),
        ({"src_page_indices": [8], "chunk_offset": 1}, "chunk_offset: 1: .*expected 2"),
        ({"src_page_indices": [8, 9, 10], "chunk_offset": 2}, "src_page_indices: the chunk ends at page 5"),
        ({"src_page_indices": [8, 8], "chunk_offset": 2}, "src_page_indices: source pages repeat"),
        ({"src_page_indices": [8, 99], "chunk_offset": 2}, "src_page_indices: source page out of range"),
        (
            {"src_page_indices": [8, 9], "chunk_offset": 2, "aux": {"meta": [1, 2]}},
            r"aux\[meta\]: sender names 2 rows, receiver declared 1",
        ),
        ({"src_page_indices": [8, 9], "chunk_offset": 2, "aux": {"nope": [1]}}, "no aux region named 'nope'"),
    ]
    for kw, match in bad:
        with pytest.raises(InvalidArgument, match=match):
            eng.ka.send_delta("t-bad", eng.a, peer_address=eng.peer, **kw)
        assert eng.changed_pages(mid) == set(), kw
    assert eng.changed_rows(before_aux) == {"meta": set(), "state": set()}
    eng.ka.send_delta(
        "t-bad", eng.a, src_page_indices=[8, 9], chunk_offset=2, aux={"meta": [0]}, peer_address=eng.peer
    )
    (r,) = eng.kb.wait("t-bad", timeout=10)
    assert r.state == "DONE" and r.route_note == "lane", r
    assert eng.pages(eng.pb, dst) == eng.pages(eng.pa, [5, 6, 8, 9])
    assert eng.rows(eng.pb, "meta", [3]) == eng.rows(eng.pa, "meta", [0])
    assert eng.changed_pages(before) <= set(dst)
    # as over gRPC: a chunk right after the last one is a bad chunk_offset, and writes nothing
    after = eng.snapshot()
    with pytest.raises(InvalidArgument, match="chunk_offset: 4 follows the last chunk .*ended DONE"):
        eng.ka.send_delta("t-bad", eng.a, src_page_indices=[8], chunk_offset=4, peer_address=eng.peer)
    assert eng.changed_pages(after) == set()
    _clean(eng)


def test_a_last_chunk_short_of_the_delta_fails_the_transfer(eng: Engines) -> None:
    eng.kb.expect_delta("t-short", eng.b, prefix_pages=0, dst_page_indices=[1, 2, 3])
    eng.ka.send_delta("t-short", eng.a, src_page_indices=[5], last_chunk=False, peer_address=eng.peer)
    with pytest.raises(FailedPrecondition, match="1 of 3 delta pages unsent"):
        eng.ka.send_delta("t-short", eng.a, src_page_indices=[6], chunk_offset=1, peer_address=eng.peer)
    (r,) = eng.kb.wait("t-short", timeout=10)
    (s,) = eng.ka.wait("t-short", timeout=10)
    assert r.state == s.state == "FAILED" and "unsent" in r.error, r
    with pytest.raises(FailedPrecondition, match="ended FAILED"):
        eng.ka.send_delta("t-short", eng.a, src_page_indices=[7], chunk_offset=2, peer_address=eng.peer)
    _clean(eng)


def test_declared_aux_rows_never_sent_fail_the_receiver(eng: Engines) -> None:
    eng.kb.expect_delta("t-noaux", eng.b, prefix_pages=0, dst_page_indices=[1, 2], aux={"meta": [3]})
    _send_chunks(eng, "t-noaux", [5, 6], [1], {})
    (r,) = eng.kb.wait("t-noaux", timeout=10)
    assert r.state == "FAILED" and "aux rows" in r.error, r
    _clean(eng)


def test_abort_mid_stream_ends_it_and_no_byte_lands_after(eng: Engines) -> None:
    before = eng.snapshot()
    eng.kb.expect_delta("t-ab", eng.b, prefix_pages=0, dst_page_indices=[1, 2, 3])
    eng.ka.send_delta("t-ab", eng.a, src_page_indices=[5], last_chunk=False, peer_address=eng.peer)
    eng.kb.abort("t-ab")
    (r,) = eng.kb.wait("t-ab", timeout=10)
    assert r.state == "ABORTED", r
    with pytest.raises(FailedPrecondition):
        eng.ka.send_delta("t-ab", eng.a, src_page_indices=[6, 7], chunk_offset=1, peer_address=eng.peer)
    (s,) = eng.ka.wait("t-ab", timeout=10)
    assert s.state in ("FAILED", "ABORTED"), s
    assert eng.changed_pages(before) <= {1}, "nothing after the Abort"
    _clean(eng)


def test_the_receivers_deadline_ends_a_stream_waiting_for_chunks(eng: Engines) -> None:
    eng.kb.expect_delta("t-dl", eng.b, prefix_pages=0, dst_page_indices=[1, 2], deadline_ms=300)
    eng.ka.send_delta("t-dl", eng.a, src_page_indices=[5], last_chunk=False, peer_address=eng.peer)
    (r,) = eng.kb.wait("t-dl", timeout=10)
    assert r.state == "FAILED" and r.error_code == "DEADLINE_EXCEEDED", r
    (s,) = eng.ka.wait("t-dl", timeout=10)
    assert s.state == "FAILED", s
    _clean(eng)


def test_the_senders_session_ending_mid_stream_fails_the_transfer(eng: Engines) -> None:
    other = Client(eng.server.address, client_name="prefill-2")
    try:
        a2 = other.register_buffers(LAYOUT, eng.pa.k_regions, eng.pa.v_regions, aux=eng.pa.aux_specs)
        eng.kb.expect_delta("t-gone", eng.b, prefix_pages=0, dst_page_indices=[1, 2])
        other.send_delta(
            "t-gone", a2.buffer_set_id, src_page_indices=[5], last_chunk=False, peer_address=eng.peer
        )
        assert other.lane_sent == 1
    finally:
        other.close()
    (r,) = eng.kb.wait("t-gone", timeout=10)
    assert r.state == "FAILED", r
    _clean(eng)


def test_a_transfer_whose_first_chunk_went_over_grpc_stays_there(eng: Engines) -> None:
    """Sent before its ExpectDelta, the first chunk falls back: its later chunks follow it."""
    src, dst = [3, 9, 14], [30, 1, 7]
    eng.ka.send_delta("t-g", eng.a, src_page_indices=src[:1], last_chunk=False, peer_address=eng.peer)
    eng.kb.expect_delta("t-g", eng.b, prefix_pages=0, dst_page_indices=dst)
    eng.ka.send_delta("t-g", eng.a, src_page_indices=src[1:], chunk_offset=1, peer_address=eng.peer)
    (r,) = eng.kb.wait("t-g", timeout=10)
    assert r.state == "DONE" and r.route_note != "lane", r
    assert eng.pages(eng.pb, dst) == eng.pages(eng.pa, src)
    assert eng.ka.lane_sent == 0
    _clean(eng)


def test_many_chunked_transfers_each_once_and_nothing_left(eng: Engines) -> None:
    rng = np.random.default_rng(7)
    for i in range(40):
        n = int(rng.integers(1, 9))
        src = rng.choice(LAYOUT.num_pages, n, replace=False).tolist()
        dst = rng.choice(LAYOUT.num_pages, n, replace=False).tolist()
        cuts = sorted(rng.integers(0, n + 1, int(rng.integers(0, 4))).tolist())
        tid = f"m-{i}"
        eng.kb.expect_delta(tid, eng.b, prefix_pages=0, dst_page_indices=dst, aux={"state": [i % 8]})
        _send_chunks(eng, tid, src, cuts, {"state": [(i + 1) % 8]})
        (r,) = eng.kb.wait(tid, timeout=10)
        assert r.state == "DONE" and r.route_note == "lane", (i, r)
        assert eng.pages(eng.pb, dst) == eng.pages(eng.pa, src)
        assert eng.rows(eng.pb, "state", [i % 8]) == eng.rows(eng.pa, "state", [(i + 1) % 8])
    eventually(lambda: eng.lane.book.sent == 40, 20, "all booked")
    _clean(eng)
