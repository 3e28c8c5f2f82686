"""Page-size conversions across services on the cross-node lane (CPU: NIXL over UCX on DRAM, shm
pools): a prefill service's pool and a decode service's pool whose pages differ only in size
(vLLM's block 16 beside SGLang's page 1 or 64; token-major pages: ``nhd``, ``nhc``, MLA) move
units of gcd(page sizes) tokens from the sender's lane into the receiver's, one-shot, in chunks
with aux rows, or streamed through a slot smaller than the delta; every token lands at its
sequence position, byte exact, with a partly filled last page on either side; nothing outside
the named pages changes; a last chunk that leaves a receiver page unsent fails both sides;
head-major pools of two page sizes convert over gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import Layout
from kvservice_client._errors import FailedPrecondition

from tests.support.nodes import Converting, Nodes, expect_offered, regions, send_chunks
from tests.support.poll import eventually
from tests.support.tokens import UNIT_CASES, check_landed

pytest.importorskip("nixl")
AUX = {"meta": (48, 16)}


def _layout(page_size: int, page_layout: str = "nhd", num_pages: int = 64, **kw: Any) -> Layout:
    shape = {"num_layers": 2, "total_kv_heads": 2, "head_dim": 8, "dtype": "float16", **kw}
    return Layout.mha(page_size=page_size, num_pages=num_pages, page_layout=page_layout, **shape)  # type: ignore[arg-type]


@pytest.fixture
def nodes(make_server: Any, tmp_path: Any) -> Iterator[Converting]:
    made = Converting(make_server, str(tmp_path), AUX)
    yield made
    made.close()


def _settled(n: Nodes) -> None:
    for s in (n.sa, n.sb):
        eventually(lambda s=s: s.app.node.transfers.table.live() == [], 10, "nothing live")
        eventually(lambda s=s: s.app.lane.result().native.cross_count() == 0, 10, "nothing on the lane")


@pytest.mark.parametrize("case", UNIT_CASES)
def test_pools_of_two_page_sizes_exchange_tokens_on_the_cross_node_lane(
    nodes: Converting,
    case: tuple[int, int, str, int, list[int], int, int, int],
) -> None:
    ps, pd, page_layout, n_src, cuts, start, prefix, n_dst = case
    src_l, dst_l = _layout(ps, page_layout), _layout(pd, page_layout)
    n = nodes(src_l, dst_l, auth="insecure")
    rng = np.random.default_rng(n_src * 31 + n_dst)
    src = rng.permutation(src_l.num_pages)[:n_src].tolist()
    dst = rng.permutation(dst_l.num_pages)[:n_dst].tolist()
    before = n.b.snapshot()
    lane_before = n.a.kv.lane_sent
    expect_offered(n, "x-u", dst, prefix)
    send_chunks(n, "x-u", src, cuts, start)
    (r,) = n.b.kv.wait("x-u", timeout=30)
    (s,) = n.a.kv.wait("x-u", timeout=30)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == s.route_note == "cross-node lane", (r, s)
    assert n.a.kv.lane_sent - lane_before == len(cuts) + 1, "every chunk went over the lane"
    check_landed(
        regions(n.a.pool, src_l), regions(n.b.pool, dst_l), before, (ps, pd), src, start, prefix, dst
    )
    for kv in (n.b.kv, n.a.kv):
        polled = eventually(lambda kv=kv: (p := kv.poll(["x-u"])[0]).state == "DONE" and p, 10, "booked")
        assert polled.state == "DONE", polled
    _settled(n)


@pytest.mark.parametrize("auth", ["token", "mtls"])
def test_sglang_shaped_chunks_with_aux_rows_convert_under_token_and_mtls_peers(
    nodes: Converting, auth: str
) -> None:
    """Our SGLang backend's shape (chunks, aux rows on the last), SGLang page 1 into vLLM block
    16: on the lane under Helm's default (a peer token) and under mutual TLS."""
    src_l, dst_l = _layout(1, num_pages=128), _layout(16)
    n = nodes(src_l, dst_l, auth=auth)
    src, dst = list(range(100, 60, -1)), [9, 2, 30]  # 40 tokens: the receiver's last page holds 8
    before = n.b.snapshot()
    expect_offered(n, "x-aux", dst, 0, aux={"meta": [1, 7]})
    send_chunks(n, "x-aux", src, [16, 33], aux={"meta": [4, 3]})
    (r,) = n.b.kv.wait("x-aux", timeout=30)
    (s,) = n.a.kv.wait("x-aux", timeout=30)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == s.route_note == "cross-node lane", (r, s)
    check_landed(regions(n.a.pool, src_l), regions(n.b.pool, dst_l), before, (1, 16), src, 0, 0, dst)
    assert n.b.rows("meta", [1, 7]) == n.a.rows("meta", [4, 3])
    _settled(n)


def test_a_delta_above_half_the_staging_streams_units_through_the_slot(nodes: Converting) -> None:
    """lane_cross_stream=all, lane_cross_mb=1 (a 256 KiB slot): 64 KiB pages of 16 tokens into
    pages of 4, a 768 KiB delta, streamed in units of 4 tokens; byte exact."""
    big = {"total_kv_heads": 4, "head_dim": 128}
    src_l, dst_l = _layout(16, num_pages=32, **big), _layout(4, num_pages=64, **big)
    assert src_l.page_bytes_all_layers == 64 << 10
    n = nodes(src_l, dst_l, auth="insecure", lane_cross_mb=1, lane_cross_stream="all")
    src, dst = [5, 1, 9, 30, 2, 17, 11], list(range(40, 12, -1))  # 112 tokens: 28 pages of 4
    before = n.b.snapshot()
    expect_offered(n, "x-big", dst, 0)
    send_chunks(n, "x-big", src, [])
    (r,) = n.b.kv.wait("x-big", timeout=30)
    (s,) = n.a.kv.wait("x-big", timeout=30)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == s.route_note == "cross-node lane", (r, s)
    check_landed(regions(n.a.pool, src_l), regions(n.b.pool, dst_l), before, (16, 4), src, 0, 0, dst)
    _settled(n)


def test_a_last_chunk_that_leaves_a_receiver_page_unsent_fails_both_sides(nodes: Converting) -> None:
    n = nodes(_layout(4), _layout(16), auth="insecure")
    before = n.b.snapshot()
    expect_offered(n, "x-s", [1, 2, 3], 0)
    n.a.kv.send_delta(
        "x-s", n.a.bs, src_page_indices=[5, 6, 7, 8], chunk_offset=0, last_chunk=False, peer_address=n.peer
    )
    with pytest.raises(FailedPrecondition, match="2 of 3 delta pages unsent"):  # 20 of 48 tokens
        n.a.kv.send_delta(
            "x-s", n.a.bs, src_page_indices=[9], chunk_offset=4, last_chunk=True, peer_address=n.peer
        )
    (r,) = n.b.kv.wait("x-s", timeout=30)
    (s,) = n.a.kv.wait("x-s", timeout=30)
    assert r.state == s.state == "FAILED" and "unsent" in r.error, (r, s)
    assert n.b.changed(before) <= {1, 2}  # only the declared pages the first chunk filled
    _settled(n)


def test_head_major_pools_of_two_page_sizes_convert_over_grpc(nodes: Converting) -> None:
    """HND pages hold a token's rows apart (one run per head): the lane answers FALLBACK and the
    SDK's gRPC call converts them across services, byte exact."""
    src_l, dst_l = _layout(16, "hnd"), _layout(4, "hnd")
    n = nodes(src_l, dst_l, auth="insecure")
    src, dst = [3, 8], [1, 5, 9, 11, 13, 2, 4, 6]
    lane_before = n.a.kv.lane_sent
    expect_offered(n, "x-h", dst, 0)
    n.a.kv.send_delta("x-h", n.a.bs, src_page_indices=src, peer_address=n.peer)
    (r,) = n.b.kv.wait("x-h", timeout=30)
    assert r.state == "DONE" and r.route_note != "cross-node lane", r
    assert n.a.kv.lane_sent == lane_before
    heads = 2
    for ra, rb in zip(regions(n.a.pool, src_l), regions(n.b.pool, dst_l), strict=True):
        a = ra[src].reshape(len(src), heads, 16, -1).transpose(0, 2, 1, 3).reshape(len(src) * 16, -1)
        b = rb[dst].reshape(len(dst), heads, 4, -1).transpose(0, 2, 1, 3).reshape(len(dst) * 4, -1)
        np.testing.assert_array_equal(a, b)
    _settled(n)
