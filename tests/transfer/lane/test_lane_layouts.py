"""Page-layout conversions on the native lane (CPU: shm pools, memcpy): pools of one model whose
pages order their bytes differently (vLLM's ``nhc`` beside SGLang's ``nhd``, ``hnd``,
FlashInfer's ``kv_nhd``, ...) exchange each head's K and V rows on the lane, in any number of
chunks and with aux rows: every head's rows land at their token, byte exact (read against the
layouts' definitions, not the service's), nothing outside the named pages changes; pools of two
page layouts and two page sizes still convert, over gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import Layout

from tests.support.lane import Engines
from tests.support.page_layouts import heads_kv
from tests.support.poll import eventually


def _layout(page_layout: str, page_size: int = 4, **kw: Any) -> Layout:
    shape = {"num_layers": 2, "num_pages": 32, "total_kv_heads": 4, "head_dim": 8, "dtype": "float16", **kw}
    return Layout.mha(page_size=page_size, page_layout=page_layout, **shape)  # type: ignore[arg-type]


@pytest.fixture
def server(make_server: Any) -> Any:
    return make_server(transport="loopback")


@pytest.fixture
def made(server: Any) -> Iterator[list[Engines]]:
    got: list[Engines] = []
    yield got
    for e in got:
        e.close()


def _send(e: Engines, tid: str, src: list[int], cuts: list[int], aux: Any = None) -> None:
    bounds = [0, *cuts, len(src)]
    for i in range(len(bounds) - 1):
        last = i == len(bounds) - 2
        e.ka.send_delta(
            tid,
            e.a,
            src_page_indices=src[bounds[i] : bounds[i + 1]],
            chunk_offset=bounds[i],
            last_chunk=last,
            aux=aux if last else None,
            peer_address=e.peer,
        )


def _check(e: Engines, src: list[int], prefix: int, dst: list[int], before: list[np.ndarray]) -> None:
    """The receiver's pages ``dst`` hold the sender's ``src[prefix:]`` head by head; every other
    receiver page is as it was."""
    ks, vs = heads_kv(Engines.regions(e.pa), src[prefix:], e.layout)
    kd, vd = heads_kv(Engines.regions(e.pb), dst, e.dst_layout)
    for a, b in zip(ks + vs, kd + vd, strict=True):
        np.testing.assert_array_equal(b, a)
    assert e.changed_pages(before) <= set(dst)


PAIRS = [
    pytest.param("nhc", "nhd", id="vllm-nhc-to-sglang-nhd"),
    pytest.param("nhd", "nhc", id="sglang-nhd-to-vllm-nhc"),
    pytest.param("nhd", "hnd", id="nhd-to-hnd"),
    pytest.param("hnd", "nhd", id="hnd-to-nhd"),
    pytest.param("kv_nhd", "nhc", id="flashinfer-kv-nhd-to-nhc"),
    pytest.param("hnc", "hnd_kv", id="hnc-to-vllm-cpu-hnd-kv"),
    pytest.param("nhc", "kv_hnd", id="nhc-to-kv-hnd"),
]


@pytest.mark.parametrize("src_pl,dst_pl", PAIRS)
@pytest.mark.parametrize("cuts", [[], [1, 3]], ids=["one-shot", "3-chunks"])
def test_pools_of_two_page_layouts_exchange_heads_on_the_lane(
    server: Any, made: list[Engines], src_pl: str, dst_pl: str, cuts: list[int]
) -> None:
    e = Engines(server, _layout(src_pl), dst_layout=_layout(dst_pl))
    made.append(e)
    src, dst, prefix = [7, 3, 20, 11, 30, 2], [9, 0, 14, 25], 2
    before = e.snapshot()
    e.kb.expect_delta("t-l", e.b, prefix_pages=prefix, dst_page_indices=dst)
    _send(e, "t-l", src, cuts)
    (r,) = e.kb.wait("t-l", timeout=10)
    (s,) = e.ka.wait("t-l", timeout=10)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == s.route_note == "lane", (r, s)
    assert e.ka.lane_sent == len(cuts) + 1, "every chunk went over the lane"
    _check(e, src, prefix, dst, before)
    eventually(lambda: e.lane.book.n.armed_count() == 0, 10, "nothing armed")
    eventually(lambda: server.node.transfers.table.live() == [], 10, "nothing live")


def test_k_and_v_of_two_head_dims_and_aux_rows_convert_on_the_lane(server: Any, made: list[Engines]) -> None:
    """K and V rows of different sizes (head_dim 8, head_dim_v 16), nhc into nhd, in two chunks
    with aux rows on the last: both land."""
    e = Engines(
        server, _layout("nhc", head_dim_v=16), dst_layout=_layout("nhd", head_dim_v=16), aux={"meta": (32, 8)}
    )
    made.append(e)
    src, dst = [5, 6, 1], [12, 13, 4]
    before = e.snapshot()
    e.kb.expect_delta("t-kv", e.b, prefix_pages=0, dst_page_indices=dst, aux={"meta": [3]})
    _send(e, "t-kv", src, [2], aux={"meta": [6]})
    (r,) = e.kb.wait("t-kv", timeout=10)
    assert r.state == "DONE" and r.route_note == "lane", r
    _check(e, src, 0, dst, before)
    assert e.rows(e.pb, "meta", [3]) == e.rows(e.pa, "meta", [6])


def test_two_page_layouts_and_two_page_sizes_convert_over_grpc(server: Any, made: list[Engines]) -> None:
    """A page layout and a page size both differing is not the lane's (yet): the SDK's gRPC call
    converts it, byte exact by token."""
    e = Engines(server, _layout("nhc", page_size=8), dst_layout=_layout("nhd", page_size=4))
    made.append(e)
    src, dst = [3, 8], [1, 5, 9, 11]
    e.kb.expect_delta("t-g", e.b, prefix_pages=0, dst_page_indices=dst)
    e.ka.send_delta("t-g", e.a, src_page_indices=src, peer_address=e.peer)
    (r,) = e.kb.wait("t-g", timeout=10)
    assert r.state == "DONE" and r.route_note != "lane", r
    assert e.ka.lane_sent == 0
    ks, vs = heads_kv(Engines.regions(e.pa), src, e.layout)
    kd, vd = heads_kv(Engines.regions(e.pb), dst, e.dst_layout)
    for a, b in zip(ks + vs, kd + vd, strict=True):  # by token: 2 pages of 8 = 4 pages of 4
        np.testing.assert_array_equal(b.reshape(-1, *b.shape[2:]), a.reshape(-1, *a.shape[2:]))
