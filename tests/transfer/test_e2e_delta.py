"""End to end (two services, loopback transport): only the delta after the receiver's prefix moves.

Multi-turn sessions, full prefix hits with aux rows, chunked sends, every data path; bytes
in the destination pages, counters on both sides, and canary pages left untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvservice_client import Layout

from tests.support.pools import assert_pages_equal, assert_unchanged, snapshot
from tests.support.transfers import LAYOUT, fused_pair, link, one

AUX = {"meta": (64, 32)}
PATHS = ["direct", "packed", "auto"]


def check_counters(st: Any, sent: int, skipped: int, layout: Layout = LAYOUT) -> None:
    assert st.state == "DONE", st
    assert (st.pages_sent, st.pages_skipped) == (sent, skipped), st
    assert st.bytes_sent == sent * layout.page_bytes_all_layers, st


@pytest.mark.parametrize("path", PATHS)
def test_multi_turn_session_moves_only_the_delta(pair, make_pool, make_client, path) -> None:
    """Turn k declares the pages of turn k-1 as prefix; only the new pages move, nothing else changes."""
    ln = link(pair, make_pool, make_client)
    rng = np.random.default_rng(7)
    src_free, dst_free = list(rng.permutation(48)), list(rng.permutation(48))
    src_seq: list[int] = []  # sender pages of the sequence, in order
    dst_seq: list[int] = []  # receiver pages it already holds, in order
    for turn, n in enumerate([3, 7, 12, 13]):
        src_seq += [int(src_free.pop()) for _ in range(n - len(src_seq))]
        new_dst = [int(dst_free.pop()) for _ in range(n - len(dst_seq))]
        before = snapshot(ln.pb)
        tid = f"turn-{path}-{turn}"
        prefix = len(dst_seq)
        ln.kb.expect_delta(tid, ln.b, prefix_pages=prefix, dst_page_indices=new_dst)
        ln.ka.send_delta(tid, ln.a, src_page_indices=src_seq, peer_address=ln.peer, path=path)
        r, s = one(ln.kb, tid), one(ln.ka, tid)
        check_counters(r, n - prefix, prefix)
        check_counters(s, n - prefix, prefix)
        if fused_pair(pair):  # pools mapped by the sender: fused unless the staged path was asked for
            want = "PACKED" if path == "packed" else "FUSED"
            assert (r.path, s.path) == (want, want)
        elif path != "auto":
            assert (r.path, s.path) == (path.upper(), path.upper())
        assert_pages_equal(ln.pb, new_dst, ln.pa, src_seq[prefix:])
        assert_unchanged(ln.pb, before, except_pages=new_dst)
        dst_seq += new_dst
    assert_pages_equal(ln.pb, dst_seq, ln.pa, src_seq)  # the whole conversation, page by page


@pytest.mark.parametrize("path", PATHS)
def test_full_prefix_hit_moves_no_kv_but_delivers_aux(pair, make_pool, make_client, path) -> None:
    """Receiver holds every page: the only chunk is all skipped, the transfer completes, aux rows land."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    before = snapshot(ln.pb)
    ln.kb.expect_delta("hit", ln.b, prefix_pages=5, dst_page_indices=[], aux={"meta": [5]})
    ln.ka.send_delta(
        "hit", ln.a, src_page_indices=[9, 3, 4, 1, 0], peer_address=ln.peer, aux={"meta": [9]}, path=path
    )
    r, s = one(ln.kb, "hit"), one(ln.ka, "hit")
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert (r.pages_sent, r.pages_skipped, s.pages_sent, s.pages_skipped) == (0, 5, 0, 5)
    assert np.array_equal(ln.pb.aux("meta")[5], ln.pa.aux("meta")[9])
    now = ln.pb.aux("meta").copy()
    now[5] = before[-1][5]
    assert np.array_equal(now, before[-1]), "aux rows other than the declared one changed"
    assert_unchanged(ln.pb, before[:-1] + [ln.pb.aux("meta").copy()])


def test_bytes_sent_agree_on_both_sides_with_aux(pair, make_pool, make_client) -> None:
    """Sender and receiver report the same bytes_sent for one transfer carrying KV and aux rows."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    ln.kb.expect_delta("ab", ln.b, prefix_pages=1, dst_page_indices=[2, 3], aux={"meta": [1, 2]})
    ln.ka.send_delta("ab", ln.a, src_page_indices=[5, 6, 7], peer_address=ln.peer, aux={"meta": [3, 4]})
    r, s = one(ln.kb, "ab"), one(ln.ka, "ab")
    assert (r.state, s.state) == ("DONE", "DONE")
    assert_pages_equal(ln.pb, [2, 3], ln.pa, [6, 7])
    assert np.array_equal(ln.pb.aux("meta")[[1, 2]], ln.pa.aux("meta")[[3, 4]])
    assert r.bytes_sent == s.bytes_sent, (r.bytes_sent, s.bytes_sent)


@pytest.mark.parametrize("path", PATHS)
def test_last_chunk_empty_after_full_hit_completes_with_aux(pair, make_pool, make_client, path) -> None:
    """Chunks: all-prefix pages, then an empty last chunk carrying only the aux rows."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    before = snapshot(ln.pb)
    ln.kb.expect_delta("e", ln.b, prefix_pages=4, dst_page_indices=[], aux={"meta": [0, 31]})
    ln.ka.send_delta("e", ln.a, src_page_indices=[1, 2], peer_address=ln.peer, last_chunk=False, path=path)
    ln.ka.send_delta(
        "e", ln.a, src_page_indices=[3, 4], chunk_offset=2, peer_address=ln.peer, last_chunk=False, path=path
    )
    ln.ka.send_delta(
        "e", ln.a, src_page_indices=[], chunk_offset=4, peer_address=ln.peer, aux={"meta": [7, 8]}, path=path
    )
    r, s = one(ln.kb, "e"), one(ln.ka, "e")
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert (r.pages_sent, r.pages_skipped) == (0, 4)
    assert np.array_equal(ln.pb.aux("meta")[[0, 31]], ln.pa.aux("meta")[[7, 8]])
    assert_unchanged(ln.pb, before[:-1] + [ln.pb.aux("meta").copy()])


@pytest.mark.parametrize("path", PATHS)
def test_chunked_send_with_empty_chunks_lands_every_page(pair, make_pool, make_client, path) -> None:
    """Five contiguous chunks (one straddling the prefix, two empty non-last) fill the delta exactly."""
    ln = link(pair, make_pool, make_client)
    src = list(range(20, 35))  # 15 sequence pages
    dst = [40, 1, 2, 3, 17, 16, 15, 5, 6, 7, 30, 31]  # 3 prefix pages, 12 delta
    before = snapshot(ln.pb)
    ln.kb.expect_delta("c", ln.b, prefix_pages=3, dst_page_indices=dst)
    cuts = [(0, 5), (5, 5), (5, 9), (9, 9), (9, 15)]
    for i, (lo, hi) in enumerate(cuts):
        ln.ka.send_delta(
            "c",
            ln.a,
            src_page_indices=src[lo:hi],
            chunk_offset=lo,
            last_chunk=i == len(cuts) - 1,
            peer_address=ln.peer,
            path=path,
        )
    r, s = one(ln.kb, "c"), one(ln.ka, "c")
    check_counters(r, 12, 3)
    check_counters(s, 12, 3)
    assert_pages_equal(ln.pb, dst, ln.pa, src[3:])
    assert_unchanged(ln.pb, before, except_pages=dst)
