"""Operators see the host tier: Prometheus series and the ``kvservice status`` header."""

from __future__ import annotations

import numpy as np
from kvservice_client import Client, Layout, ShmKVPool, page_hashes
from kvservice_client.proto import kvservice_pb2 as pb

from kvservice.cli._render import header
from kvservice.metrics import Metrics

LAYOUT = Layout.mha(num_layers=1, page_size=4, num_pages=8, total_kv_heads=1, head_dim=8, dtype="float16")
HASHES = page_hashes(np.arange(16), 4)


def _offload_three(server) -> None:
    with ShmKVPool.create(LAYOUT) as pool, Client(server.address, client_name="e") as kv:
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions, engine_id="e").buffer_set_id
        kv.offload_pages(bs, [0, 1, 2], HASHES[:3])
        kv.load_pages(bs, [5], HASHES[1:2])


def test_tier_series_count_stores_loads_and_bytes(server) -> None:
    """The scrape carries the tier's pages, bytes and counters, labelled tier="host"."""
    _offload_three(server)
    text = Metrics(server.node).exposition().decode()
    page = LAYOUT.page_bytes_k + LAYOUT.page_bytes_v
    assert 'kvservice_tier_pages{tier="host"} 3.0' in text
    assert f'kvservice_tier_used_bytes{{tier="host"}} {3 * page}.0' in text
    assert 'kvservice_tier_stored_pages_total{tier="host"} 3.0' in text
    assert 'kvservice_tier_loaded_pages_total{tier="host"} 1.0' in text
    assert 'kvservice_tier_fill_backlog_pages{tier="host"} 0.0' in text


def test_status_header_shows_the_tier(server) -> None:
    """``kvservice status`` names the tier's use, pages and loads (and "off" without one)."""
    _offload_three(server)
    with Client(server.address) as kv:
        text = str(header(kv.get_stats(), server.address).renderable)
    assert "host tier" in text and "3 pages" in text and "1 loaded" in text
    assert "host tier [dim]off[/]" in str(header(pb.GetStatsResponse(), "x").renderable)
