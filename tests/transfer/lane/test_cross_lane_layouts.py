"""Page-layout conversions across services on the cross-node lane (CPU: NIXL over UCX on DRAM, shm
pools): a prefill pool of one page layout (vLLM's ``nhc``, SGLang's ``nhd``, ``hnd``, FlashInfer's
``kv_nhd``) and a decode pool of another: the sender packs each head's rows into the receiver's
page layout, one-shot, in chunks with aux rows, or streamed through a slot smaller than the delta,
and the receiver unpacks its own pages; every head's rows land at their token, byte exact (read
against the layouts' definitions), nothing outside the named pages changes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import Layout

from tests.support.nodes import Converting, Nodes, expect_offered, regions, send_chunks
from tests.support.page_layouts import heads_kv
from tests.support.poll import eventually

pytest.importorskip("nixl")
AUX = {"meta": (48, 16)}


def _layout(page_layout: str, page_size: int = 4, **kw: Any) -> Layout:
    shape = {"num_layers": 2, "num_pages": 32, "total_kv_heads": 4, "head_dim": 8, "dtype": "float16", **kw}
    return Layout.mha(page_size=page_size, page_layout=page_layout, **shape)  # type: ignore[arg-type]


@pytest.fixture
def nodes(make_server: Any, tmp_path: Any) -> Iterator[Converting]:
    made = Converting(make_server, str(tmp_path), AUX)
    yield made
    made.close()


def _move(
    n: Nodes, tid: str, src: list[int], prefix: int, dst: list[int], cuts: list[int], aux: bool
) -> None:
    expect_offered(n, tid, dst, prefix, aux={"meta": [5]} if aux else None)
    send_chunks(n, tid, src, cuts, aux={"meta": [9]} if aux else None)


def _check(n: Nodes, src: list[int], dst: list[int], before: list[np.ndarray]) -> None:
    ks, vs = heads_kv(regions(n.a.pool, n.a.layout), src, n.a.layout)
    kd, vd = heads_kv(regions(n.b.pool, n.b.layout), dst, n.b.layout)
    for a, b in zip(ks + vs, kd + vd, strict=True):
        np.testing.assert_array_equal(b, a)
    assert n.b.changed(before) <= set(dst)


CASES = [
    # (sender layout, receiver layout, chunk cuts, aux rows, auth)
    pytest.param("nhc", "nhd", [], False, "insecure", id="vllm-nhc-to-sglang-nhd"),
    pytest.param("nhd", "nhc", [1, 3], True, "token", id="sglang-nhd-to-vllm-nhc-chunks-aux-token-peers"),
    pytest.param("hnd", "kv_nhd", [2], False, "mtls", id="hnd-to-flashinfer-kv-nhd-mtls"),
    pytest.param("hnc", "hnd_kv", [], True, "insecure", id="hnc-to-vllm-cpu-hnd-kv"),
]


@pytest.mark.parametrize("src_pl,dst_pl,cuts,aux,auth", CASES)
def test_pools_of_two_page_layouts_exchange_heads_on_the_cross_node_lane(
    nodes: Converting,
    src_pl: str,
    dst_pl: str,
    cuts: list[int],
    aux: bool,
    auth: str,
) -> None:
    n = nodes(_layout(src_pl), _layout(dst_pl), auth=auth)
    src, dst, prefix = [7, 3, 20, 11, 30, 2], [9, 1, 14, 25], 2
    before = n.b.snapshot()
    lane_before = n.a.kv.lane_sent
    _move(n, "x-l", src, prefix, dst, cuts, aux)
    (r,) = n.b.kv.wait("x-l", timeout=30)
    (s,) = n.a.kv.wait("x-l", timeout=30)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == s.route_note == "cross-node lane", (r, s)
    assert n.a.kv.lane_sent - lane_before == len(cuts) + 1, "every chunk went over the lane"
    _check(n, src[prefix:], dst, before)
    if aux:
        assert n.b.rows("meta", [5]) == n.a.rows("meta", [9])
    for s_ in (n.sa, n.sb):
        eventually(lambda s_=s_: s_.app.lane.result().native.cross_count() == 0, 10, "nothing on the lane")


def test_a_delta_above_half_the_staging_streams_converted_pages(nodes: Converting) -> None:
    """lane_cross_stream=all, lane_cross_mb=1 (a 256 KiB slot): 64 KiB pages, nhc into nhd, a 640
    KiB delta streamed through the slot in the receiver's page layout."""
    big = {"total_kv_heads": 8, "head_dim": 64, "page_size": 16}
    src_l, dst_l = _layout("nhc", **big), _layout("nhd", **big)
    assert src_l.page_bytes_all_layers == 64 << 10
    n = nodes(src_l, dst_l, auth="insecure", lane_cross_mb=1, lane_cross_stream="all")
    src, dst = list(range(3, 13)), list(range(30, 20, -1))
    before = n.b.snapshot()
    _move(n, "x-big", src, 0, dst, [], False)
    (r,) = n.b.kv.wait("x-big", timeout=30)
    assert r.state == "DONE" and r.route_note == "cross-node lane", r
    _check(n, src, dst, before)


def test_two_page_layouts_and_two_page_sizes_convert_over_grpc(nodes: Converting) -> None:
    """Both the page layout and the page size differ: not the lane's (yet); gRPC converts it."""
    n = nodes(_layout("nhc", page_size=8), _layout("nhd"), auth="insecure")
    src, dst = [3, 8], [1, 5, 9, 11]
    lane_before = n.a.kv.lane_sent
    _move(n, "x-g", src, 0, dst, [], False)
    (r,) = n.b.kv.wait("x-g", timeout=30)
    assert r.state == "DONE" and r.route_note != "cross-node lane", r
    assert n.a.kv.lane_sent == lane_before
    ks, vs = heads_kv(regions(n.a.pool, n.a.layout), src, n.a.layout)
    kd, vd = heads_kv(regions(n.b.pool, n.b.layout), dst, n.b.layout)
    for a, b in zip(ks + vs, kd + vd, strict=True):  # by token: 2 pages of 8 = 4 pages of 4
        np.testing.assert_array_equal(b.reshape(-1, *b.shape[2:]), a.reshape(-1, *a.shape[2:]))


def test_later_offers_of_one_receiver_geometry_convert_too(nodes: Converting) -> None:
    """The sender's lane keeps a receiver's page geometry from its first offer: the next
    transfers into it (no geometry sent again) still pack into the receiver's page layout."""
    n = nodes(_layout("nhc"), _layout("nhd"), auth="insecure")
    for turn, (src, dst) in enumerate([([7, 3], [9, 1]), ([20, 11, 30], [14, 25, 2]), ([4], [6])]):
        before = n.b.snapshot()
        _move(n, f"x-again-{turn}", src, 0, dst, [], False)
        (r,) = n.b.kv.wait(f"x-again-{turn}", timeout=30)
        assert r.state == "DONE" and r.route_note == "cross-node lane", r
        _check(n, src, dst, before)
