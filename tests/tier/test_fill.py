"""The write-behind fill: within its budget, off the engine's call, never keeping bytes the
engine evicted meanwhile, and filling what a DONE ExpectDelta delivered."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvservice_client import Client, Layout, ShmKVPool, page_hashes

from kvservice.tier import LayoutKey
from tests.support.pools import fill_random, regions_of

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=32, total_kv_heads=2, head_dim=8, dtype="float16")
PAGE = 2 * LAYOUT.num_layers * LAYOUT.page_bytes_k  # K and V of every layer
TOKENS = np.arange(900, 900 + 16 * 4)
HASHES = page_hashes(TOKENS, 4)
KEY = LayoutKey.of(LAYOUT)


@pytest.fixture
def engine(server):
    pool = ShmKVPool.create(LAYOUT)
    fill_random(pool, 7)
    kv = Client(server.address, client_name="engine")
    bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions, engine_id="e").buffer_set_id
    yield kv, bs, pool
    kv.close()
    pool.close()


def page_of(pool: ShmKVPool, p: int) -> bytes:
    return b"".join(r[p].tobytes() for r in regions_of(pool))


def tier_page(server, h: int) -> bytes:
    t = server.node.tier.tier
    load = t.begin_load(KEY, np.array([h], dtype=np.uint64))
    try:
        return t.slots_view(KEY)[load.slots[0]].tobytes()
    finally:
        t.end_load(load)


def test_fill_stays_within_its_budget(make_server) -> None:
    """At host_tier_fill_gbps the second publish waits its share: 8 pages a second here."""
    server = make_server(host_tier_fill_gbps=8 * PAGE / 1e9)
    with ShmKVPool.create(LAYOUT) as pool, Client(server.address) as kv:
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        t0 = time.monotonic()
        kv.publish_pages(bs, np.arange(8), tokens=TOKENS[:32])  # returns at once: nothing copied on the call
        kv.publish_pages(bs, np.arange(16), tokens=TOKENS)
        assert time.monotonic() - t0 < 0.5
        time.sleep(0.3)
        st = server.node.tier.tier.stats()
        assert st.held_pages == 8 and st.fill_backlog_pages == 16  # the second publish's hashes
        assert server.node.tier.filler.drain()
        assert time.monotonic() - t0 >= 0.95 and server.node.tier.tier.stats().held_pages == 16
        server.node.tier.tier.check_integrity()


def test_page_evicted_during_its_copy_is_not_kept(engine, server, monkeypatch) -> None:
    """A page the engine evicted while the fill read it is dropped; the others are kept."""
    kv, bs, pool = engine
    from kvservice.tier import fill

    real = fill.to_tier

    def evict_then_copy(b, pages, arena, slots) -> None:
        server.node.index.evict(bs, np.array([3]))  # page 3 and its descendants (4, 5)
        real(b, pages, arena, slots)

    monkeypatch.setattr(fill, "to_tier", evict_then_copy)
    kv.publish_pages(bs, np.arange(6), tokens=TOKENS[:24])
    assert server.node.tier.filler.drain()
    t = server.node.tier.tier
    assert t.held(KEY, HASHES[:6]).tolist() == [True, True, True, False, False, False]
    assert tier_page(server, int(HASHES[1])) == page_of(pool, 1)
    t.check_integrity()


def test_fill_of_an_unregistered_buffer_set_copies_nothing(make_server) -> None:
    """Publishes queued behind a slow fill are skipped once their buffer set is gone, leaking no slot."""
    server = make_server(host_tier_fill_gbps=8 * PAGE / 1e9)
    with ShmKVPool.create(LAYOUT) as pool, Client(server.address) as kv:
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        kv.publish_pages(bs, np.arange(8), tokens=TOKENS[:32])
        kv.publish_pages(bs, np.arange(16), tokens=TOKENS)
        time.sleep(0.2)
        kv.unregister_buffers(bs)
        assert server.node.tier.filler.drain()
    t = server.node.tier.tier
    assert t.stats().held_pages == 8 and t.stats().fill_backlog_pages == 0
    t.check_integrity()


def test_pages_a_transfer_delivered_are_filled(make_server) -> None:
    """A DONE ExpectDelta with publish tokens fills the receiver's pages into its node's tier."""
    a, b = make_server(transport="loopback"), make_server(transport="loopback")
    with ShmKVPool.create(LAYOUT) as pa, ShmKVPool.create(LAYOUT) as pb:
        fill_random(pa, 11)
        with Client(a.address) as ka, Client(b.address) as kb:
            sa = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
            sb = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
            kb.expect_delta(
                "t1", sb, prefix_pages=0, dst_page_indices=[10, 11, 12], publish_tokens=TOKENS[:12]
            )
            ka.send_delta("t1", sa, src_page_indices=[0, 1, 2], peer_address=b.app.peer_address)
            assert {s.state for s in kb.wait("t1", timeout=20)} == {"DONE"}
            assert b.node.tier.filler.drain()
            assert b.node.tier.tier.held(KEY, HASHES[:3]).all()
            assert [tier_page(b, int(h)) for h in HASHES[:3]] == [page_of(pa, p) for p in range(3)]
            b.node.tier.tier.check_integrity()
