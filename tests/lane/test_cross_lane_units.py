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

from tests.support.nodes import Nodes, regions
from tests.support.poll import eventually
from tests.support.tokens import check_landed

pytest.importorskip("nixl")
AUX = {"meta": (48, 16)}


def _layout(page_size: int, page_layout: str = "nhd", num_pages: int = 64, **kw: Any) -> Layout:
    shape = {"num_layers": 2, "total_kv_heads": 2, "head_dim": 8, "dtype": "float16", **kw}
    return Layout.mha(page_size=page_size, num_pages=num_pages, page_layout=page_layout, **shape)  # type: ignore[arg-type]


@pytest.fixture
def made(make_server: Any, tmp_path: Any) -> Iterator[list[Nodes]]:
    got: list[Nodes] = []
    yield got
    for n in got:
        n.close()


def _nodes(made: list[Nodes], make_server: Any, tmp: Any, src: Layout, dst: Layout, **kw: Any) -> Nodes:
    n = Nodes(make_server, str(tmp), cross_lane=True, layouts=(src, dst), aux=AUX, **kw)
    made.append(n)
    warm = n.a.kv, n.b.kv  # a first transfer over gRPC opens the channel A -> B (offers travel on it)
    warm[1].expect_delta(
        "warm", n.b.bs, prefix_pages=0, dst_page_indices=[0], sender_address=n.sa.app.peer_address
    )
    warm[0].send_delta("warm", n.a.bs, src_page_indices=[0], peer_address=n.peer)
    assert warm[1].wait("warm", timeout=30)[0].state == "DONE"
    return n


def _expect(n: Nodes, tid: str, dst: list[int], prefix: int, **kw: Any) -> None:
    n.b.kv.expect_delta(
        tid, n.b.bs, prefix_pages=prefix, dst_page_indices=dst, sender_address=n.sa.app.peer_address, **kw
    )
    eventually(lambda: n.sa.app.lane.result().native.cross_count() > 0, 10, f"offer of {tid}")


def _send(n: Nodes, tid: str, src: list[int], cuts: list[int], start: int = 0, aux: Any = None) -> None:
    bounds = [0, *cuts, len(src)]
    for i in range(len(bounds) - 1):
        last = i == len(bounds) - 2
        n.a.kv.send_delta(
            tid,
            n.a.bs,
            src_page_indices=src[bounds[i] : bounds[i + 1]],
            chunk_offset=start + bounds[i],
            last_chunk=last,
            aux=aux if last else None,
            peer_address=n.peer,
        )


def _settled(n: Nodes) -> None:
    for s in (n.sa, n.sb):
        eventually(lambda s=s: s.app.node.transfers.table.live() == [], 10, "nothing live")
        eventually(lambda s=s: s.app.lane.result().native.cross_count() == 0, 10, "nothing on the lane")


CASES = [
    # (sender page, receiver page, layout, sender pages, chunk cuts, start, receiver prefix, receiver pages)
    pytest.param(16, 4, "nhd", 3, [], 0, 2, 10, id="16-to-4"),
    pytest.param(4, 16, "nhd", 12, [5], 0, 0, 3, id="4-to-16-2-chunks"),
    pytest.param(1, 4, "nhd", 24, [7, 8, 19], 0, 1, 5, id="sglang-page-1-to-4-4-chunks"),
    pytest.param(4, 1, "nhd", 6, [], 0, 3, 21, id="4-to-sglang-page-1"),
    pytest.param(6, 4, "nhd", 4, [1, 3], 0, 1, 5, id="6-to-4-gcd-2"),
    pytest.param(16, 4, "nhd", 3, [], 0, 1, 10, id="16-to-4-sender-last-page-part-filled"),
    pytest.param(4, 16, "nhd", 11, [4], 0, 0, 3, id="4-to-16-receiver-last-page-part-filled"),
    pytest.param(16, 4, "nhd", 2, [1], 1, 4, 8, id="16-to-4-first-chunk-inside-the-prefix"),
    pytest.param(16, 1, "nhc", 2, [1], 0, 5, 27, id="vllm-nhc-16-to-1"),
]


@pytest.mark.parametrize("ps,pd,page_layout,n_src,cuts,start,prefix,n_dst", CASES)
def test_pools_of_two_page_sizes_exchange_tokens_on_the_cross_node_lane(
    made: list[Nodes],
    make_server: Any,
    tmp_path: Any,
    ps: int,
    pd: int,
    page_layout: str,
    n_src: int,
    cuts: list[int],
    start: int,
    prefix: int,
    n_dst: int,
) -> None:
    src_l, dst_l = _layout(ps, page_layout), _layout(pd, page_layout)
    n = _nodes(made, make_server, tmp_path, src_l, dst_l, auth="insecure")
    rng = np.random.default_rng(n_src * 31 + n_dst)
    src = rng.permutation(src_l.num_pages)[:n_src].tolist()
    dst = rng.permutation(dst_l.num_pages)[:n_dst].tolist()
    before = n.b.snapshot()
    lane_before = n.a.kv.lane_sent
    _expect(n, "x-u", dst, prefix)
    _send(n, "x-u", src, cuts, start)
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
    made: list[Nodes], make_server: Any, tmp_path: Any, auth: str
) -> None:
    """Our SGLang backend's shape (chunks, aux rows on the last), SGLang page 1 into vLLM block
    16: on the lane under Helm's default (a peer token) and under mutual TLS."""
    src_l, dst_l = _layout(1, num_pages=128), _layout(16)
    n = _nodes(made, make_server, tmp_path, src_l, dst_l, auth=auth)
    src, dst = list(range(100, 60, -1)), [9, 2, 30]  # 40 tokens: the receiver's last page holds 8
    before = n.b.snapshot()
    _expect(n, "x-aux", dst, 0, aux={"meta": [1, 7]})
    _send(n, "x-aux", src, [16, 33], aux={"meta": [4, 3]})
    (r,) = n.b.kv.wait("x-aux", timeout=30)
    (s,) = n.a.kv.wait("x-aux", timeout=30)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == s.route_note == "cross-node lane", (r, s)
    check_landed(regions(n.a.pool, src_l), regions(n.b.pool, dst_l), before, (1, 16), src, 0, 0, dst)
    assert n.b.rows("meta", [1, 7]) == n.a.rows("meta", [4, 3])
    _settled(n)


def test_a_delta_above_half_the_staging_streams_units_through_the_slot(
    made: list[Nodes], make_server: Any, tmp_path: Any
) -> None:
    """lane_cross_stream=all, lane_cross_mb=1 (a 256 KiB slot): 64 KiB pages of 16 tokens into
    pages of 4, a 768 KiB delta, streamed in units of 4 tokens; byte exact."""
    big = {"total_kv_heads": 4, "head_dim": 128}
    src_l, dst_l = _layout(16, num_pages=32, **big), _layout(4, num_pages=64, **big)
    assert src_l.page_bytes_all_layers == 64 << 10
    n = _nodes(
        made, make_server, tmp_path, src_l, dst_l, auth="insecure", lane_cross_mb=1, lane_cross_stream="all"
    )
    src, dst = [5, 1, 9, 30, 2, 17, 11], list(range(40, 12, -1))  # 112 tokens: 28 pages of 4
    before = n.b.snapshot()
    _expect(n, "x-big", dst, 0)
    _send(n, "x-big", src, [])
    (r,) = n.b.kv.wait("x-big", timeout=30)
    (s,) = n.a.kv.wait("x-big", timeout=30)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == s.route_note == "cross-node lane", (r, s)
    check_landed(regions(n.a.pool, src_l), regions(n.b.pool, dst_l), before, (16, 4), src, 0, 0, dst)
    _settled(n)


def test_a_last_chunk_that_leaves_a_receiver_page_unsent_fails_both_sides(
    made: list[Nodes], make_server: Any, tmp_path: Any
) -> None:
    n = _nodes(made, make_server, tmp_path, _layout(4), _layout(16), auth="insecure")
    before = n.b.snapshot()
    _expect(n, "x-s", [1, 2, 3], 0)
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


def test_head_major_pools_of_two_page_sizes_convert_over_grpc(
    made: list[Nodes], make_server: Any, tmp_path: Any
) -> None:
    """HND pages hold a token's rows apart (one run per head): the lane answers FALLBACK and the
    SDK's gRPC call converts them across services, byte exact."""
    src_l, dst_l = _layout(16, "hnd"), _layout(4, "hnd")
    n = _nodes(made, make_server, tmp_path, src_l, dst_l, auth="insecure")
    src, dst = [3, 8], [1, 5, 9, 11, 13, 2, 4, 6]
    lane_before = n.a.kv.lane_sent
    _expect(n, "x-h", dst, 0)
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
