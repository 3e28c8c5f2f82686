"""Page-size conversions on the native lane (CPU: shm pools, memcpy): pools whose page sizes differ
(SGLang's page 1 or 64 beside vLLM's block 16) exchange units of gcd(page sizes) tokens on the
lane when their pages hold token rows in order (``nhd``, ``nhc``): every token lands at its
sequence position, byte exact, in any number of chunks, with a partly filled last page on either
side; nothing outside the named pages changes; a chunk past the delta is refused as over gRPC;
head-major pools of two page sizes still convert, over gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import Client, Layout, ShmKVPool
from kvservice_client._errors import FailedPrecondition, InvalidArgument

from tests.support.lane import lane_of
from tests.support.poll import eventually
from tests.support.tokens import UNIT_CASES, check_landed


def _layout(page_size: int, page_layout: str = "nhd", num_pages: int = 64) -> Layout:
    return Layout.mha(
        num_layers=2,
        page_size=page_size,
        num_pages=num_pages,
        total_kv_heads=2,
        head_dim=8,
        dtype="float16",
        page_layout=page_layout,  # type: ignore[arg-type]
    )


class Pair:
    """A sender and a receiver engine on one service, pools of two layouts, random bytes."""

    def __init__(self, server: Any, src: Layout, dst: Layout) -> None:
        self.server, self.src, self.dst = server, src, dst
        self.lane = lane_of(server)
        self.pa, self.pb = ShmKVPool.create(src), ShmKVPool.create(dst)
        rng = np.random.default_rng(5)
        for pool in (self.pa, self.pb):
            for r in self._regions(pool):
                r[:] = rng.integers(0, 256, r.shape, dtype=np.uint8)
        self.ka = Client(server.address, client_name="prefill")
        self.kb = Client(server.address, client_name="decode")
        self.a = self.ka.register_buffers(src, self.pa.k_regions, self.pa.v_regions).buffer_set_id
        self.b = self.kb.register_buffers(dst, self.pb.k_regions, self.pb.v_regions).buffer_set_id
        self.peer = server.app.peer_address

    @staticmethod
    def _regions(pool: ShmKVPool) -> list[np.ndarray]:
        lay = pool.layout
        return [pool.k(i) for i in range(lay.num_layers)] + [pool.v(i) for i in range(lay.num_v_regions)]

    def snapshot(self) -> list[np.ndarray]:
        return [r.copy() for r in self._regions(self.pb)]

    def close(self) -> None:
        self.ka.close()
        self.kb.close()
        self.pa.close()
        self.pb.close()


@pytest.fixture
def server(make_server: Any) -> Any:
    return make_server(transport="loopback")


@pytest.fixture
def pairs(server: Any) -> Iterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for p in made:
        p.close()


def _send(p: Pair, tid: str, src: list[int], cuts: list[int], start: int = 0) -> None:
    bounds = [0, *cuts, len(src)]
    for i in range(len(bounds) - 1):
        p.ka.send_delta(
            tid,
            p.a,
            src_page_indices=src[bounds[i] : bounds[i + 1]],
            chunk_offset=start + bounds[i],
            last_chunk=i == len(bounds) - 2,
            peer_address=p.peer,
        )


def _check_landed(
    p: Pair, src: list[int], start: int, prefix: int, dst: list[int], before: list[np.ndarray]
) -> None:
    check_landed(
        p._regions(p.pa),
        p._regions(p.pb),
        before,
        (p.src.page_size, p.dst.page_size),
        src,
        start,
        prefix,
        dst,
    )


@pytest.mark.parametrize("case", UNIT_CASES)
def test_pools_of_two_page_sizes_exchange_tokens_on_the_lane(
    server: Any,
    pairs: list[Pair],
    case: tuple[int, int, str, int, list[int], int, int, int],
) -> None:
    ps, pd, page_layout, n_src, cuts, start, prefix, n_dst = case
    p = Pair(server, _layout(ps, page_layout), _layout(pd, page_layout))
    pairs.append(p)
    rng = np.random.default_rng(n_src * 31 + n_dst)
    src = rng.permutation(p.src.num_pages)[:n_src].tolist()
    dst = rng.permutation(p.dst.num_pages)[:n_dst].tolist()
    before = p.snapshot()
    p.kb.expect_delta("t-u", p.b, prefix_pages=prefix, dst_page_indices=dst)
    _send(p, "t-u", src, cuts, start)
    (r,) = p.kb.wait("t-u", timeout=10)
    (s,) = p.ka.wait("t-u", timeout=10)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert r.route_note == "lane" and s.route_note == "lane", "the END came over the lane"
    assert p.ka.lane_sent == len(cuts) + 1, "every chunk went over the lane"
    _check_landed(p, src, start, prefix, dst, before)
    eventually(lambda: p.lane.book.sent == 1, 10, "booked")
    polled = {x.role: x for x in p.kb.poll(["t-u"]) + p.ka.poll(["t-u"])}
    assert polled["RECEIVER"].state == polled["SENDER"].state == "DONE"
    eventually(lambda: p.lane.book.n.armed_count() == 0, 10, "nothing armed")
    eventually(lambda: server.node.transfers.table.live() == [], 10, "nothing live")


def test_a_later_chunk_past_the_delta_is_invalid_and_the_transfer_goes_on(
    server: Any, pairs: list[Pair]
) -> None:
    p = Pair(server, _layout(4), _layout(16))
    pairs.append(p)
    src, dst = list(range(10, 22)), [7, 3, 9]  # 12 pages of 4 tokens = 3 of 16
    before = p.snapshot()
    p.kb.expect_delta("t-x", p.b, prefix_pages=0, dst_page_indices=dst)
    p.ka.send_delta(
        "t-x", p.a, src_page_indices=src[:4], chunk_offset=0, last_chunk=False, peer_address=p.peer
    )
    with pytest.raises(InvalidArgument, match="ends at page 13"):
        p.ka.send_delta("t-x", p.a, src_page_indices=src[4:] + [40], chunk_offset=4, peer_address=p.peer)
    p.ka.send_delta("t-x", p.a, src_page_indices=src[4:], chunk_offset=4, peer_address=p.peer)
    (r,) = p.kb.wait("t-x", timeout=10)
    assert r.state == "DONE" and r.route_note == "lane", r
    _check_landed(p, src, 0, 0, dst, before)


def test_a_last_chunk_that_leaves_a_receiver_page_unsent_fails_the_transfer(
    server: Any, pairs: list[Pair]
) -> None:
    p = Pair(server, _layout(4), _layout(16))
    pairs.append(p)
    p.kb.expect_delta("t-s", p.b, prefix_pages=0, dst_page_indices=[1, 2, 3])
    p.ka.send_delta(
        "t-s", p.a, src_page_indices=[5, 6, 7, 8], chunk_offset=0, last_chunk=False, peer_address=p.peer
    )
    with pytest.raises(FailedPrecondition, match="2 of 3 delta pages unsent"):  # 28 of 48 tokens
        p.ka.send_delta(
            "t-s", p.a, src_page_indices=[9], chunk_offset=4, last_chunk=True, peer_address=p.peer
        )
    (r,) = p.kb.wait("t-s", timeout=10)
    (s,) = p.ka.wait("t-s", timeout=10)
    assert r.state == s.state == "FAILED" and "unsent" in r.error, r
    eventually(lambda: p.lane.book.n.armed_count() == 0, 10, "nothing armed")


def test_head_major_pools_of_two_page_sizes_convert_over_grpc(server: Any, pairs: list[Pair]) -> None:
    """HND pages hold a token's rows apart (one run per head): the lane refuses the pair and the
    SDK's gRPC call converts it, byte exact."""
    p = Pair(server, _layout(16, "hnd"), _layout(4, "hnd"))
    pairs.append(p)
    src, dst = [3, 8], [1, 5, 9, 11, 13, 2, 4, 6]
    p.kb.expect_delta("t-h", p.b, prefix_pages=0, dst_page_indices=dst)
    p.ka.send_delta("t-h", p.a, src_page_indices=src, peer_address=p.peer)
    (r,) = p.kb.wait("t-h", timeout=10)
    assert r.state == "DONE" and r.route_note != "lane", r
    assert p.ka.lane_sent == 0
    heads, ps, pd = 2, 16, 4
    for region_a, region_b in zip(Pair._regions(p.pa), Pair._regions(p.pb), strict=True):
        a = region_a[src].reshape(len(src), heads, ps, -1).transpose(0, 2, 1, 3).reshape(len(src) * ps, -1)
        b = region_b[dst].reshape(len(dst), heads, pd, -1).transpose(0, 2, 1, 3).reshape(len(dst) * pd, -1)
        np.testing.assert_array_equal(a, b)


def test_mla_pools_of_two_page_sizes_exchange_tokens_on_the_lane(server: Any, pairs: list[Pair]) -> None:
    """MLA's latent (one region a layer, token-major): page 64 into page 1, in two chunks."""
    lay = {"num_layers": 2, "latent_dim": 72, "dtype": "bfloat16"}
    p = Pair(
        server, Layout.mla(page_size=64, num_pages=4, **lay), Layout.mla(page_size=1, num_pages=256, **lay)
    )
    pairs.append(p)
    src, dst = [2, 0], list(range(255, 255 - 100, -1))  # 128 tokens; the receiver holds 28 already
    before = p.snapshot()
    p.kb.expect_delta("t-mla", p.b, prefix_pages=28, dst_page_indices=dst)
    _send(p, "t-mla", src, [1])
    (r,) = p.kb.wait("t-mla", timeout=10)
    assert r.state == "DONE" and r.route_note == "lane", r
    assert p.ka.lane_sent == 2
    _check_landed(p, src, 0, 28, dst, before)
