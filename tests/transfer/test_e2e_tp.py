"""End to end (loopback): mixed TP and MLA, one buffer set (and one client) per TP rank.

Every rank's pool is cut from one global KV (``tests.support.pools.fill_tp``); after the transfer
each receiver rank must hold exactly its heads of the sent pages at the right head offsets::

    H=4, p=1 -> d=2: sender heads 0..3 ─┬─ [0,2) ─▶ rank 0 heads 0..1
                                        └─ [2,4) ─▶ rank 1 heads 0..1
    H=4, p=4 -> d=2: rank 0 gets sender 0 at head 0, sender 1 at head 1; rank 1 senders 2, 3
    H=2, p=4 -> d=2: senders hold replicas (0,1: head 0; 2,3: head 1); one replica per head sends
"""

from __future__ import annotations

from typing import Any

import pytest
from kvservice_client import Layout

from tests.support.pools import assert_tp_pages, assert_unchanged, fill_random, fill_tp, global_kv, snapshot
from tests.support.transfers import fused_pair, wait_all

PAGES = 24
SRC = [5, 9, 2, 11, 20, 3, 14, 7]  # 8 sequence pages; receiver holds the first 3
PREFIX = 3
DST = [1, 0, 22, 13, 6]


def mha(tp: int, rank: int, heads: int) -> Layout:
    return Layout.mha(
        num_layers=2,
        page_size=2,
        num_pages=PAGES,
        total_kv_heads=heads,
        head_dim=4,
        dtype="float16",
        tp_size=tp,
        tp_rank=rank,
    )


def mla(tp: int, rank: int, heads: int = 1) -> Layout:
    return Layout.mla(
        num_layers=2, page_size=2, num_pages=PAGES, latent_dim=576, dtype="bfloat16", tp_size=tp, tp_rank=rank
    )


def ranks(server: Any, make_pool: Any, make_client: Any, tp: int, make_layout: Any, heads: int) -> list[Any]:
    """One (client, pool, buffer set) per rank, as engine ranks would register."""
    out = []
    for r in range(tp):
        lay = make_layout(tp, r, heads)
        pool = make_pool(lay)
        kv = make_client(server)
        bs = kv.register_buffers(lay, pool.k_regions, pool.v_regions).buffer_set_id
        out.append((kv, pool, bs))
    return out


def run_tp(pair, make_pool, make_client, make_layout, heads, p, d, path, tid, **expect: Any):
    sa, sb = pair
    senders = ranks(sa, make_pool, make_client, p, make_layout, heads)
    receivers = ranks(sb, make_pool, make_client, d, make_layout, heads)
    glob = global_kv(make_layout(1, 0, heads), seed=11)
    for _, pool, _ in senders:
        fill_tp(pool, glob)
    for i, (_, pool, _) in enumerate(receivers):
        fill_random(pool, 100 + i)
    before = [snapshot(pool) for _, pool, _ in receivers]
    for kv, _, bs in receivers:
        kv.expect_delta(tid, bs, prefix_pages=PREFIX, dst_page_indices=DST, **expect)
    for kv, _, bs in senders:  # two chunks per sender rank
        kv.send_delta(
            tid, bs, src_page_indices=SRC[:4], peer_address=sb.app.peer_address, last_chunk=False, path=path
        )
        kv.send_delta(
            tid, bs, src_page_indices=SRC[4:], chunk_offset=4, peer_address=sb.app.peer_address, path=path
        )
    rsts = [wait_all(kv, tid)[0] for kv, _, _ in receivers]
    ssts = [wait_all(kv, tid)[0] for kv, _, _ in senders]
    assert [s.state for s in rsts + ssts] == ["DONE"] * (d + p), rsts + ssts
    for (_, pool, _), snap in zip(receivers, before, strict=True):
        assert_tp_pages(pool, DST, glob, SRC[PREFIX:])
        assert_unchanged(pool, snap, except_pages=DST)
    return senders, receivers, rsts, ssts


TP_CASES = [
    pytest.param(4, 1, 2, id="H4-tp1to2"),
    pytest.param(4, 2, 1, id="H4-tp2to1"),
    pytest.param(4, 4, 2, id="H4-tp4to2"),
    pytest.param(2, 4, 2, id="H2-tp4to2-replicated"),
    pytest.param(2, 1, 4, id="H2-tp1to4-replicated-receivers"),
]


@pytest.mark.parametrize("path", ["packed", "auto"])
@pytest.mark.parametrize("heads,p,d", TP_CASES)
def test_mixed_tp_head_slices_land_at_their_offsets(pair, make_pool, make_client, heads, p, d, path) -> None:
    """Each receiver rank ends DONE holding its heads of the delta pages; canaries untouched."""
    run_tp(
        pair, make_pool, make_client, mha, heads, p, d, path, f"tp-{heads}-{p}-{d}-{path}", expected_senders=0
    )


@pytest.mark.parametrize("heads,p,d", [(4, 2, 1), (4, 4, 2)])
def test_receiver_ranks_need_not_count_senders(pair, make_pool, make_client, heads, p, d) -> None:
    """ExpectDelta without expected_senders (client default) works when several sender ranks write a rank."""
    run_tp(pair, make_pool, make_client, mha, heads, p, d, "auto", "dflt")


def test_explicit_expected_senders_is_accepted(pair, make_pool, make_client) -> None:
    """TP 4 -> 2: receiver ranks declaring expected_senders=2 complete."""
    run_tp(pair, make_pool, make_client, mha, 4, 4, 2, "packed", "exp2", expected_senders=2)


@pytest.mark.parametrize("heads,p,d", TP_CASES)
def test_mixed_tp_counters(pair, make_pool, make_client, heads, p, d) -> None:
    """Receiver ranks count the delta pages once and exactly their bytes; senders' bytes add up."""
    _, receivers, rsts, ssts = run_tp(
        pair, make_pool, make_client, mha, heads, p, d, "auto", "cnt", expected_senders=0
    )
    delta = len(SRC) - PREFIX
    for (_, pool, _), st in zip(receivers, rsts, strict=True):
        assert st.bytes_sent == delta * pool.layout.page_bytes_all_layers, st
        assert (st.pages_sent, st.pages_skipped) == (delta, PREFIX), st
    assert sum(s.bytes_sent for s in ssts) == sum(r.bytes_sent for r in rsts)
    for s in ssts:
        assert s.pages_sent + s.pages_skipped == len(SRC), s


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2)])
def test_mla_replicated_latent_moves_once_per_receiver_rank(pair, make_pool, make_client, p, d) -> None:
    """MLA (latent 576): exactly one sender rank sends; every receiver rank gets the full latent pages."""
    senders, receivers, rsts, ssts = run_tp(
        pair, make_pool, make_client, mla, 1, p, d, "auto", f"mla-{p}-{d}", expected_senders=0
    )
    delta = len(SRC) - PREFIX
    page = mla(1, 0).page_bytes_all_layers
    assert sorted(s.pages_sent for s in ssts) == [0] * (p - 1) + [delta], ssts
    for st in rsts:
        assert st.bytes_sent == delta * page, st
    assert sum(s.bytes_sent for s in ssts) == d * delta * page


def test_direct_path_refuses_head_slicing(pair, make_pool, make_client) -> None:
    """path=direct with TP 1 -> 2 (heads must be sliced) fails FAILED_PRECONDITION between two services;
    nothing written. On one service the fused route serves it."""
    sa, sb = pair
    senders = ranks(sa, make_pool, make_client, 1, mha, 4)
    receivers = ranks(sb, make_pool, make_client, 2, mha, 4)
    fill_random(senders[0][1], 3)
    for i, (_, pool, _) in enumerate(receivers):
        fill_random(pool, 30 + i)
    before = [snapshot(pool) for _, pool, _ in receivers]
    for kv, _, bs in receivers:
        kv.expect_delta("dir", bs, prefix_pages=0, dst_page_indices=[1, 2], deadline_ms=5000)
    kv, _, bs = senders[0]
    kv.send_delta("dir", bs, src_page_indices=[3, 4], peer_address=sb.app.peer_address, path="direct")
    s = wait_all(kv, "dir")[0]
    if fused_pair(pair):  # pools mapped by the sender: the fused copy slices heads page to page
        assert (s.state, s.path) == ("DONE", "FUSED"), s
        return
    assert (s.state, s.error_code) == ("FAILED", "FAILED_PRECONDITION"), s
    assert "DIRECT" in s.error
    for kv, _, _ in receivers:
        r = wait_all(kv, "dir", timeout=3)[0]
        assert r.state == "FAILED", r
    for (_, pool, _), snap in zip(receivers, before, strict=True):
        assert_unchanged(pool, snap)


def test_sender_ranks_writing_one_receiver_rank_do_not_clobber_each_other(
    pair, make_pool, make_client
) -> None:
    """TP 4 -> 1, many pages, repeated: four sender ranks' head slices of the same pages all survive."""
    sa, sb = pair
    lay = lambda tp, r, h: Layout.mha(  # noqa: E731
        num_layers=2,
        page_size=8,
        num_pages=128,
        total_kv_heads=4,
        head_dim=32,
        dtype="float16",
        tp_size=tp,
        tp_rank=r,
    )
    senders = ranks(sa, make_pool, make_client, 4, lay, 4)
    ((kv_r, pool_r, bs_r),) = ranks(sb, make_pool, make_client, 1, lay, 4)
    glob = global_kv(lay(1, 0, 4), seed=5)
    for _, pool, _ in senders:
        fill_tp(pool, glob)
    src = list(range(128))
    for rep in range(4):
        tid = f"clobber-{rep}"
        fill_random(pool_r, rep)
        kv_r.expect_delta(tid, bs_r, prefix_pages=0, dst_page_indices=src[::-1], expected_senders=0)
        for kv, _, bs in senders:
            kv.send_delta(tid, bs, src_page_indices=src, peer_address=sb.app.peer_address, path="packed")
        st = wait_all(kv_r, tid)[0]
        assert st.state == "DONE", st
        assert_tp_pages(pool_r, src[::-1], glob, src)


@pytest.mark.parametrize("heads,p,d", [(4, 2, 1), (4, 1, 2), (2, 4, 2)])
def test_mixed_tp_landing_then_claim(pair, make_pool, make_client, heads, p, d) -> None:
    """Landing across TP sizes: every receiver rank lands its head slices (LANDED), then claims
    them into its pages; each rank holds exactly its heads of the delta pages."""
    sa, sb = pair
    tid = f"land-tp-{heads}-{p}-{d}"
    senders = ranks(sa, make_pool, make_client, p, mha, heads)
    receivers = ranks(sb, make_pool, make_client, d, mha, heads)
    glob = global_kv(mha(1, 0, heads), seed=12)
    for _, pool, _ in senders:
        fill_tp(pool, glob)
    for i, (_, pool, _) in enumerate(receivers):
        fill_random(pool, 200 + i)
    before = [snapshot(pool) for _, pool, _ in receivers]
    for kv, _, bs in receivers:
        kv.expect_landing(tid, bs, prefix_pages=PREFIX, pages=len(SRC) - PREFIX)
    for kv, _, bs in senders:
        kv.send_delta(tid, bs, src_page_indices=SRC, peer_address=sb.app.peer_address)
    for kv, _, _ in receivers:
        (st,) = kv.wait_landed(tid, timeout=10)
        assert st.state == "LANDED", st
    assert [wait_all(kv, tid)[0].state for kv, _, _ in senders] == ["DONE"] * p
    for (kv, pool, bs), snap in zip(receivers, before, strict=True):
        assert_unchanged(pool, snap)  # nothing in the engine's pages before the claim
        assert kv.claim(tid, bs, dst_page_indices=DST).status.state == "DONE"
        assert_tp_pages(pool, DST, glob, SRC[PREFIX:])
        assert_unchanged(pool, snap, except_pages=DST)
