"""The host tier over gRPC on shm pools: write-behind fill from PublishPages, OffloadPages,
LoadPages (byte exact), MatchPrefix's tier_pages and lease, errors that change nothing."""

from __future__ import annotations

import numpy as np
import pytest
from kvservice_client import (
    Client,
    FailedPrecondition,
    InvalidArgument,
    Layout,
    NotFound,
    Offloaded,
    PermissionDenied,
    ShmKVPool,
    page_hashes,
)

from tests.support.pools import fill_random, regions_of

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=16, total_kv_heads=2, head_dim=8, dtype="float16")
TOKENS = np.arange(500, 500 + 8 * 4)  # 8 full pages
HASHES = page_hashes(TOKENS, 4)


class Engine:
    """A client with one registered shm pool of LAYOUT."""

    def __init__(self, server, name: str, seed: int) -> None:
        self.pool = ShmKVPool.create(LAYOUT)
        fill_random(self.pool, seed)
        self.kv = Client(server.address, client_name=name)
        self.bs = self.kv.register_buffers(
            LAYOUT, self.pool.k_regions, self.pool.v_regions, engine_id=name
        ).buffer_set_id

    def page(self, p: int) -> bytes:
        return b"".join(r[p].tobytes() for r in regions_of(self.pool))

    def pages(self) -> list[bytes]:
        return [self.page(p) for p in range(LAYOUT.num_pages)]

    def offload(self, pages, hashes=None) -> Offloaded:
        return self.kv.offload_pages(self.bs, list(pages), hashes)

    def load(self, pages, hashes) -> int:
        return self.kv.load_pages(self.bs, list(pages), hashes)

    def close(self) -> None:
        self.kv.close()
        self.pool.close()


@pytest.fixture
def engines(server):
    a, b = Engine(server, "prefill-0", 1), Engine(server, "decode-0", 2)
    yield a, b
    a.close()
    b.close()


def tier(server):
    t = server.node.tier
    t.tier.check_integrity()
    return t


def test_published_pages_are_filled_into_the_tier(engines, server) -> None:
    """Pages an engine publishes reach the tier in the background, byte for byte."""
    a, _ = engines
    a.kv.publish_pages(a.bs, np.arange(3, 9), tokens=TOKENS[:24])
    assert tier(server).filler.drain()
    t = tier(server)
    assert t.tier.stats().held_pages == 6
    key = t.tier._arenas and next(iter(t.tier._arenas))
    arena = t.tier.slots_view(key)
    load = t.tier.begin_load(key, HASHES[:6])
    assert [arena[s].tobytes() for s in load.slots] == [a.page(p) for p in range(3, 9)]
    t.tier.end_load(load)
    tier(server)


def test_a_page_published_twice_is_copied_once(engines, server) -> None:
    """The fill skips pages the tier holds (duplicate-aware), even from another engine."""
    a, b = engines
    a.kv.publish_pages(a.bs, np.arange(4), tokens=TOKENS[:16])
    assert tier(server).filler.drain()
    b.kv.publish_pages(b.bs, np.arange(8, 12), tokens=TOKENS[:16])
    assert tier(server).filler.drain()
    st = tier(server).tier.stats()
    assert st.stored_pages == 4 and st.duplicate_pages == 4


def test_match_prefix_reports_tier_pages_per_candidate(engines, server) -> None:
    """tier_pages counts the tier's leading pages, beyond what the engine itself still holds."""
    a, b = engines
    a.kv.publish_pages(a.bs, np.arange(6), tokens=TOKENS[:24])
    assert tier(server).filler.drain()
    a.kv.evict_pages(a.bs, [2])
    raw = b.kv.match_prefix(hashes=HASHES)
    by_bs = {x.buffer_set_id: x for x in raw.matches}
    assert by_bs[a.bs].matched_pages == 2 and by_bs[a.bs].tier_pages == 6
    assert by_bs[b.bs].matched_pages == 0 and by_bs[b.bs].tier_pages == 6
    assert raw.query_pages == 8
    tier(server)


def test_load_pages_restores_the_prefix_byte_exact(engines, server) -> None:
    """Pages filled from one engine are loaded into another engine's chosen pages, exactly."""
    a, b = engines
    a.kv.publish_pages(a.bs, np.arange(5, 11), tokens=TOKENS[:24])
    assert tier(server).filler.drain()
    want = [a.page(p) for p in range(5, 11)]
    before = b.pages()
    dst = [15, 0, 7, 3, 9, 1]
    assert b.load(dst, HASHES[:6]) == 6
    after = b.pages()
    assert [after[p] for p in dst] == want
    assert all(after[p] == before[p] for p in range(16) if p not in dst), "only the named pages change"
    assert tier(server).tier.stats().loaded_pages == 6


def test_offload_keeps_pages_the_engine_then_overwrites(engines, server) -> None:
    """OffloadPages returns once copied: the engine may overwrite the pages and load them back."""
    a, _ = engines
    want = [a.page(p) for p in (4, 5, 6)]
    r = a.offload([4, 5, 6], HASHES[:3])
    assert (r.stored_pages, r.already_held, r.not_stored) == (3, 0, 0)
    for region in regions_of(a.pool):
        region[4:7] = 0
    assert a.load([10, 11, 12], HASHES[:3]) == 3
    assert [a.page(p) for p in (10, 11, 12)] == want
    assert a.offload([10, 11, 12], HASHES[:3]).already_held == 3
    tier(server)


def test_offload_without_hashes_uses_the_index(engines, server) -> None:
    """With no hashes the index's entries at the pages name them; an unindexed page is refused."""
    a, _ = engines
    a.kv.publish_pages(a.bs, np.arange(2), tokens=TOKENS[:8])
    assert tier(server).filler.drain()
    assert a.offload([0, 1]).already_held == 2
    with pytest.raises(InvalidArgument, match=r"hashes: page_indices\[1\]"):
        a.offload([0, 5])


@pytest.mark.parametrize(
    ("pages", "hashes", "field"),
    [
        ([], [], "page_indices"),
        ([16], [1], "page_indices"),
        ([1, 1], [1, 2], "page_indices"),
        ([1, 2], [1], "hashes"),
    ],
)
def test_bad_offload_and_load_are_refused_naming_the_field(engines, server, pages, hashes, field) -> None:
    """Malformed requests are INVALID_ARGUMENT naming the field, and change nothing."""
    a, _ = engines
    before, stats = a.pages(), tier(server).tier.stats()
    for call in (a.offload, a.load):
        with pytest.raises(InvalidArgument, match=f"^{field}:"):
            call(pages, hashes)
    assert a.pages() == before and tier(server).tier.stats() == stats


def test_load_of_a_page_the_tier_lacks_writes_nothing(engines, server) -> None:
    """LoadPages is all or none: a missing hash is FAILED_PRECONDITION naming it."""
    a, _ = engines
    a.offload([0], HASHES[:1])
    before = a.pages()
    with pytest.raises(FailedPrecondition, match=r"hashes\[1\]"):
        a.load([8, 9], HASHES[:2])
    assert a.pages() == before
    tier(server)


def test_another_session_cannot_use_the_buffer_set(engines, server) -> None:
    """Offload and load need the buffer set's own session (PERMISSION_DENIED otherwise)."""
    a, b = engines
    with pytest.raises(PermissionDenied, match="buffer_set_id"):
        b.kv.offload_pages(a.bs, [0], [1])


def test_a_lease_pins_the_tier_pages_until_released(engines, server) -> None:
    """MatchPrefix's lease pins the tier's pages of the prefix; ReleaseLease unpins them."""
    a, _ = engines
    a.kv.publish_pages(a.bs, np.arange(4), tokens=TOKENS[:16])
    assert tier(server).filler.drain()
    m = a.kv.match_prefix(tokens=TOKENS, page_size=4, lease_ttl_ms=10_000)
    t = tier(server)
    assert t.tier.leases() == 1
    arena = next(iter(t.tier._arenas.values()))
    assert int(arena.slots.pins.sum()) == 4
    a.kv.release_lease(m.lease_id)
    assert tier(server).tier.leases() == 0 and int(arena.slots.pins.sum()) == 0


def test_session_end_releases_its_tier_leases(server) -> None:
    """A session that ends without releasing its lease leaves no pin in the tier."""
    e = Engine(server, "x", 3)
    e.kv.publish_pages(e.bs, np.arange(4), tokens=TOKENS[:16])
    assert tier(server).filler.drain()
    e.kv.match_prefix(tokens=TOKENS, page_size=4, lease_ttl_ms=10_000)
    assert tier(server).tier.leases() == 1
    e.close()
    from tests.support.poll import eventually

    eventually(lambda: tier(server).tier.leases() == 0)


def test_tier_off_stores_nothing(make_server) -> None:
    """host_tier_gb 0: nothing is filled, offloads report not_stored, tier_pages stay 0."""
    server = make_server(host_tier_gb=0.0)
    e = Engine(server, "x", 4)
    try:
        e.kv.publish_pages(e.bs, np.arange(4), tokens=TOKENS[:16])
        assert e.offload([0, 1], HASHES[:2]).not_stored == 2
        assert server.node.tier.tier.stats().held_pages == 0
        assert e.kv.get_stats().tier.capacity_bytes == 0
    finally:
        e.close()


def test_a_tier_only_prefix_gets_a_lease_of_its_own(engines, server) -> None:
    """With no pool holding the prefix, a lease pins the tier's pages; ReleaseLease ends it once."""
    a, b = engines
    a.offload([0, 1, 2], HASHES[:3])
    m = b.kv.match_prefix(tokens=TOKENS, page_size=4, lease_ttl_ms=10_000)
    assert m.lease_id and m.best.matched_pages == 0
    t = tier(server)
    assert t.tier.leases() == 1 and server.node.index.stats().leases == 0
    with pytest.raises(PermissionDenied):
        a.kv.release_lease(m.lease_id)
    b.kv.release_lease(m.lease_id)
    assert tier(server).tier.leases() == 0
    with pytest.raises(NotFound):
        b.kv.release_lease(m.lease_id)


def test_the_sdk_names_a_bad_hash_before_calling(engines, server) -> None:
    """Negative, fractional or too large hashes are INVALID_ARGUMENT naming "hashes" in the SDK."""
    a, _ = engines
    for bad in ([-1], [1.5], [2**64], np.array([0.5])):
        with pytest.raises(InvalidArgument, match="hashes"):
            a.kv.offload_pages(a.bs, [0], bad)
        with pytest.raises(InvalidArgument, match="hashes"):
            a.kv.load_pages(a.bs, [0], bad)
    assert a.kv.offload_pages(a.bs, [0], np.array([2**63 + 5], dtype=np.uint64)).stored_pages == 1
    assert tier(server).tier.stats().held_pages == 1
