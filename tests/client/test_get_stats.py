"""The SDK's get_stats is in the session from the first call: a fresh client's first
call sees what its identity may see, whatever else it did before."""

from __future__ import annotations

import asyncio

from kvservice_client import AsyncClient, Client, Layout, ShmKVPool

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=8, total_kv_heads=2, head_dim=8, dtype="float16")


def test_a_fresh_clients_first_get_stats_lists_the_node_for_an_admin_uid(server) -> None:
    """An operator script's one call (root over the socket: admin) lists another engine's buffer set."""
    with ShmKVPool.create(LAYOUT) as pool, Client(server.address, client_name="engine") as engine:
        bs = engine.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        with Client(server.address, client_name="ops") as ops:
            first = ops.get_stats()
            assert first.admin_view and [b.buffer_set_id for b in first.buffer_sets] == [bs]
            assert sorted(s.client_name for s in first.session_list) == ["engine", "ops"]
            assert [b.buffer_set_id for b in ops.get_stats().buffer_sets] == [bs]  # same again


def test_the_async_clients_first_get_stats_is_in_its_session_too(server) -> None:
    """AsyncClient.get_stats opens the session on its first call as well."""
    with ShmKVPool.create(LAYOUT) as pool, Client(server.address) as engine:
        bs = engine.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id

        async def first_call() -> list[str]:
            async with AsyncClient(server.address, client_name="ops-aio") as ops:
                return [b.buffer_set_id for b in (await ops.get_stats()).buffer_sets]

        assert asyncio.run(first_call()) == [bs]
