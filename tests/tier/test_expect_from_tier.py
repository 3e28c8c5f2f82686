"""ExpectDelta with from_tier: the pages the node's tier holds come from it, only the rest from
the sender (the same-node restore of DESIGN.md "Host tier"), byte-exact on shm pools."""

from __future__ import annotations

import numpy as np
import pytest
from kvservice_client import Client, InvalidArgument, Layout, ShmKVPool, TransferStatus

from tests.support.pools import fill_random, regions_of

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=32, total_kv_heads=2, head_dim=8, dtype="float16")
TOKENS = np.arange(300, 300 + 6 * 4)  # 6 pages


def expect_from_tier(kv: Client, tid: str, bs: str, dst: list[int], prefix: int = 0, **kw) -> TransferStatus:
    return kv.expect_delta(
        tid,
        bs,
        prefix_pages=prefix,
        dst_page_indices=dst,
        publish_tokens=TOKENS,
        prefix_page_indices=kw.get("prefix_idx", ()),
        from_tier=True,
    )


def test_tier_pages_are_loaded_and_the_sender_moves_only_the_rest(make_server) -> None:
    """Pages 0-2 come from the receiver node's tier, pages 3-5 from the sender; all byte-exact."""
    a, b = make_server(transport="loopback"), make_server(transport="loopback")
    with ShmKVPool.create(LAYOUT) as pa, ShmKVPool.create(LAYOUT) as pb, ShmKVPool.create(LAYOUT) as pc:
        fill_random(pa, 1)
        fill_random(pb, 2)
        fill_random(pc, 3)
        with Client(a.address) as ka, Client(b.address) as kb:
            sa = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
            sb = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
            sc = kb.register_buffers(LAYOUT, pc.k_regions, pc.v_regions).buffer_set_id
            kb.publish_pages(sc, [7, 8, 9], tokens=TOKENS[:12])  # another engine on b computed 3 pages
            assert b.node.tier.filler.drain()
            dst = [20, 21, 22, 23, 24, 25]
            expect_from_tier(kb, "t1", sb, dst)
            ka.send_delta("t1", sa, src_page_indices=list(range(6)), peer_address=b.app.peer_address)
            (st,) = kb.wait("t1", timeout=20)
            assert (st.state, st.pages_sent, st.pages_skipped) == ("DONE", 3, 3)
            for rb, rc, ra in zip(regions_of(pb), regions_of(pc), regions_of(pa), strict=True):
                assert (rb[[20, 21, 22]] == rc[[7, 8, 9]]).all(), "from the tier"
                assert (rb[[23, 24, 25]] == ra[[3, 4, 5]]).all(), "from the sender"
            m = kb.match_prefix(tokens=TOKENS, page_size=4, buffer_set_ids=[sb])
            assert m.best.matched_pages == 6 and m.best.page_indices == tuple(dst)
        b.node.tier.tier.check_integrity()


def test_from_tier_with_nothing_in_the_tier_is_a_plain_transfer(make_server) -> None:
    """When the tier holds none of the pages the sender moves all of them."""
    a, b = make_server(transport="loopback"), make_server(transport="loopback")
    with ShmKVPool.create(LAYOUT) as pa, ShmKVPool.create(LAYOUT) as pb:
        fill_random(pa, 1)
        with Client(a.address) as ka, Client(b.address) as kb:
            sa = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
            sb = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
            expect_from_tier(kb, "t2", sb, [0, 1, 2, 3, 4, 5])
            ka.send_delta("t2", sa, src_page_indices=list(range(6)), peer_address=b.app.peer_address)
            (st,) = kb.wait("t2", timeout=20)
            assert (st.state, st.pages_sent, st.pages_skipped) == ("DONE", 6, 0)
            for ra, rb in zip(regions_of(pa), regions_of(pb), strict=True):
                assert (rb[:6] == ra[:6]).all()


def test_from_tier_needs_the_pages_hashes(server) -> None:
    """Without publish tokens or hashes from_tier is INVALID_ARGUMENT naming it, nothing declared."""
    with ShmKVPool.create(LAYOUT) as pb, Client(server.address) as kb:
        sb = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
        with pytest.raises(InvalidArgument, match="from_tier"):
            kb.expect_delta("t3", sb, prefix_pages=0, dst_page_indices=[0, 1], from_tier=True)
        assert server.node.transfers.in_flight() == 0


def test_from_tier_on_the_same_node_route(make_server) -> None:
    """Sender and receiver on one service (the same-node route): the tier's pages are skipped too."""
    s = make_server(transport="loopback")
    with ShmKVPool.create(LAYOUT) as pa, ShmKVPool.create(LAYOUT) as pb:
        fill_random(pa, 5)
        fill_random(pb, 6)
        with Client(s.address) as ka, Client(s.address) as kb:
            sa = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
            sb = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
            ka.publish_pages(sa, [0, 1], tokens=TOKENS[:8])
            assert s.node.tier.filler.drain()
            ka.evict_pages(sa, all=True)  # the tier keeps what the engine let go
            expect_from_tier(kb, "t4", sb, [10, 11, 12, 13, 14, 15])
            ka.send_delta("t4", sa, src_page_indices=list(range(6)), peer_address=s.app.peer_address)
            (st,) = kb.wait("t4", timeout=20)
            assert (st.state, st.pages_sent, st.pages_skipped) == ("DONE", 4, 2)
            for ra, rb in zip(regions_of(pa), regions_of(pb), strict=True):
                assert (rb[10:16] == ra[0:6]).all()
        s.node.tier.tier.check_integrity()
