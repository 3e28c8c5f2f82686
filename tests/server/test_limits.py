"""Caps: per call (items per repeated field, tokens per call) answered INVALID_ARGUMENT, per
session (buffer sets, unfinished transfers, leases) answered RESOURCE_EXHAUSTED; each names
its option and changes nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvservice_client import Client, InvalidArgument, Layout, ResourceExhausted, ShmKVPool

LAYOUT = Layout.mha(num_layers=1, page_size=4, num_pages=32, total_kv_heads=1, head_dim=8, dtype="float16")


@pytest.fixture
def pools() -> Any:
    made = [ShmKVPool.create(LAYOUT) for _ in range(3)]
    yield made
    for p in made:
        p.close()


def _register(kv: Client, pool: ShmKVPool) -> str:
    return kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id


def test_per_call_caps(make_server: Any, pools: Any) -> None:
    s = make_server(max_pages_per_call=8, max_tokens_per_call=32)
    with Client(s.address, timeout=5) as kv:
        bs = _register(kv, pools[0])
        with pytest.raises(
            InvalidArgument, match=r"dst_page_indices: 9 items exceed max_pages_per_call \(8\)"
        ):
            kv.expect_delta("t", bs, prefix_pages=0, dst_page_indices=range(9))
        assert kv.poll(["t"]) == []  # nothing was declared
        kv.expect_delta("t", bs, prefix_pages=0, dst_page_indices=range(8))  # at the cap: fine
        kv.abort("t")
        with pytest.raises(
            InvalidArgument, match=r"tokens.u32le: 33 tokens exceed max_tokens_per_call \(32\)"
        ):
            kv.match_prefix(tokens=np.arange(33, dtype=np.uint32), page_size=4)
        assert kv.match_prefix(tokens=np.arange(32, dtype=np.uint32), page_size=4).query_pages == 8
        with pytest.raises(InvalidArgument, match="max_pages_per_call"):
            kv.publish_pages(bs, range(9), hashes=np.arange(9, dtype=np.uint64))
        assert kv.get_stats().index.entries == 0  # nothing was published


def test_per_session_caps(make_server: Any, pools: Any) -> None:
    s = make_server(max_buffer_sets_per_session=2, max_transfers_per_session=2, max_leases_per_session=1)
    with Client(s.address, timeout=5) as kv, Client(s.address, timeout=5) as other:
        a, b = _register(kv, pools[0]), _register(kv, pools[1])
        with pytest.raises(ResourceExhausted, match="max_buffer_sets_per_session"):
            _register(kv, pools[2])
        _register(other, pools[2])  # a cap per session, not per service
        kv.unregister_buffers(b)
        b = _register(kv, pools[1])

        kv.expect_delta("t1", a, prefix_pages=0, dst_page_indices=[0])
        kv.expect_delta("t2", b, prefix_pages=0, dst_page_indices=[0])
        with pytest.raises(ResourceExhausted, match="max_transfers_per_session"):
            kv.expect_delta("t3", a, prefix_pages=0, dst_page_indices=[1])
        assert kv.poll(["t3"]) == []
        kv.abort("t1")  # a finished transfer frees its place
        kv.expect_delta("t3", a, prefix_pages=0, dst_page_indices=[1])
        kv.abort("t2")
        kv.abort("t3")

        tokens = np.arange(16, dtype=np.uint32)
        kv.publish_pages(a, [4, 5, 6, 7], tokens=tokens)
        lease = kv.match_prefix(tokens=tokens, page_size=4, lease_ttl_ms=60_000).lease_id
        assert lease
        with pytest.raises(ResourceExhausted, match="max_leases_per_session"):
            kv.match_prefix(tokens=tokens, page_size=4, lease_ttl_ms=60_000)
        kv.release_lease(lease)
        assert kv.match_prefix(tokens=tokens, page_size=4, lease_ttl_ms=60_000).lease_id
