"""Prefix index over gRPC: MatchPrefix for engines and routers, leases, Publish/EvictPages, errors."""

from __future__ import annotations

import numpy as np
import pytest
from kvservice_client import (
    Client,
    InvalidArgument,
    Layout,
    NotFound,
    PermissionDenied,
    ShmKVPool,
    page_hashes,
)

from tests.support.poll import eventually

LAYOUT = Layout.mha(num_layers=1, page_size=4, num_pages=32, total_kv_heads=1, head_dim=8, dtype="float16")
TOKENS = np.arange(1000, 1000 + 10 * 4 + 3)  # 10 full pages and a partial one


@pytest.fixture
def engine(server):
    pool = ShmKVPool.create(LAYOUT)
    kv = Client(server.address, client_name="engine")
    bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions, engine_id="decode-0").buffer_set_id
    yield kv, bs
    kv.close()
    pool.close()


def test_published_prefix_matches_by_tokens_and_by_hashes(engine, server) -> None:
    """Pages published for a sequence are matched by its tokens or its canonical hashes, in order."""
    kv, bs = engine
    pages = np.arange(20, 26)
    assert kv.publish_pages(bs, pages, tokens=TOKENS[:24]) == 6
    with Client(server.address) as router:
        by_tokens = router.match_prefix(tokens=TOKENS, page_size=4)
        by_hashes = router.match_prefix(hashes=page_hashes(TOKENS, 4))
    for m in (by_tokens, by_hashes):
        assert m.query_pages == 10 and m.best.buffer_set_id == bs
        assert m.best.matched_pages == 6 and m.best.page_indices == tuple(range(20, 26))
    scores = kv.match_prefix(tokens=TOKENS, page_size=4, scores_only=True)
    assert scores.best.matched_pages == 6 and scores.best.page_indices == ()
    server.node.index.check_integrity()


def test_evict_drops_page_and_its_descendants(engine, server) -> None:
    """Evicting a middle page shortens the match to the pages before it."""
    kv, bs = engine
    kv.publish_pages(bs, np.arange(6), tokens=TOKENS[:24])
    assert kv.evict_pages(bs, [3]) == 3
    assert kv.match_prefix(tokens=TOKENS, page_size=4).best.matched_pages == 3
    assert kv.evict_pages(bs, all=True) == 3
    assert kv.get_stats().index.entries == 0


def test_lease_pins_and_reports_eviction(engine) -> None:
    """A lease belongs to its session; after its page is evicted, releasing still works."""
    kv, bs = engine
    kv.publish_pages(bs, np.arange(4), tokens=TOKENS[:16], priority=5)
    m = kv.match_prefix(tokens=TOKENS, page_size=4, lease_ttl_ms=10_000)
    assert m.lease_id and m.best.min_priority == 5
    assert kv.get_stats().index.leases == 1
    kv.evict_pages(bs, [0])
    kv.release_lease(m.lease_id)
    with pytest.raises(NotFound):
        kv.release_lease(m.lease_id)


def test_lease_of_another_session_cannot_be_released(engine, server) -> None:
    """Only the session that took a lease may release it; leases go with their session."""
    kv, bs = engine
    kv.publish_pages(bs, np.arange(2), tokens=TOKENS[:8])
    with Client(server.address) as other:
        m = other.match_prefix(tokens=TOKENS, page_size=4, lease_ttl_ms=10_000)
        with pytest.raises(PermissionDenied):
            kv.release_lease(m.lease_id)
    eventually(lambda: kv.get_stats().index.leases == 0, 5, "the other session's lease is gone with it")


@pytest.mark.parametrize(
    ("call", "error", "field"),
    [
        (lambda kv, bs: kv.match_prefix(tokens=TOKENS), InvalidArgument, "page_size"),
        (lambda kv, bs: kv.match_prefix(tokens=TOKENS, page_size=4, buffer_set_ids=["bs-x"]), NotFound, ""),
        (lambda kv, bs: kv.publish_pages(bs, [40], tokens=TOKENS[:4]), InvalidArgument, "page_indices"),
        (lambda kv, bs: kv.publish_pages(bs, [1, 1], tokens=TOKENS[:8]), InvalidArgument, "page_indices"),
        (lambda kv, bs: kv.publish_pages(bs, [1, 2, 3], tokens=TOKENS[:8]), InvalidArgument, "page_indices"),
        (lambda kv, bs: kv.publish_pages("bs-x", [1], tokens=TOKENS[:4]), NotFound, "buffer_set_id"),
        (lambda kv, bs: kv.evict_pages(bs, [-1 & 0xFFFFFFFF]), InvalidArgument, "page_indices"),
        (lambda kv, bs: kv.evict_pages(bs, [1], all=True), InvalidArgument, "page_indices"),
        (
            lambda kv, bs: kv.match_prefix(tokens=TOKENS, page_size=4, scores_only=True, lease_ttl_ms=5),
            InvalidArgument,
            "lease_ttl_ms",
        ),
        (lambda kv, bs: kv.release_lease("nope"), NotFound, ""),
    ],
)
def test_bad_index_calls_fail_clearly_and_change_nothing(engine, server, call, error, field) -> None:
    """Each bad call gets its status, names the field, and leaves the index as it was."""
    kv, bs = engine
    kv.publish_pages(bs, np.arange(3), tokens=TOKENS[:12])
    before = server.node.index.stats().entries
    with pytest.raises(error) as info:
        call(kv, bs)
    assert field in info.value.message
    assert server.node.index.stats().entries == before
    server.node.index.check_integrity()


def test_publish_to_another_sessions_buffer_set_is_denied(engine, server) -> None:
    """Only the owner keeps a buffer set's index entries."""
    kv, bs = engine
    with Client(server.address) as other:
        with pytest.raises(PermissionDenied):
            other.publish_pages(bs, [0], tokens=TOKENS[:4])


def test_lease_without_session_metadata_is_refused(engine, server) -> None:
    """A lease needs an ownership session."""
    from kvservice_client._proto import kvservice_pb2, kvservice_pb2_grpc

    kv, bs = engine
    kv.publish_pages(bs, np.arange(2), tokens=TOKENS[:8])
    stub = kvservice_pb2_grpc.KVServiceStub(kv._channel)
    req = kvservice_pb2.MatchPrefixRequest(
        hashes={"hashes": page_hashes(TOKENS, 4).tolist()}, lease_ttl_ms=100
    )
    with pytest.raises(Exception) as info:
        stub.MatchPrefix(req, timeout=5)
    assert info.value.code().name == "UNAUTHENTICATED"
