"""The asyncio client: same calls and typed results as the sync one, errors mapped."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from kvservice_client import AsyncClient, InvalidArgument, Layout, NotFound, ShmKVPool

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=8, total_kv_heads=2, head_dim=8, dtype="float16")


def test_async_client_registers_publishes_matches_and_transfers(server) -> None:
    """An engine written with asyncio does a whole local transfer (receiver and sender on one node)."""

    async def main() -> None:
        with ShmKVPool.create(LAYOUT) as src, ShmKVPool.create(LAYOUT) as dst:
            src.k(0)[:] = 7
            src.v(1)[:] = 9
            async with AsyncClient(server.address, client_name="async-engine") as kv:
                a = await kv.register_buffers(LAYOUT, src.k_regions, src.v_regions, engine_id="p")
                b = await kv.register_buffers(LAYOUT, dst.k_regions, dst.v_regions, engine_id="d")
                tokens = np.arange(16)
                assert await kv.publish_pages(a.buffer_set_id, [0, 1, 2, 3], tokens=tokens) == 4
                m = await kv.match_prefix(tokens=tokens, page_size=4, buffer_set_ids=[a.buffer_set_id])
                assert m.best.matched_pages == 4
                await kv.expect_delta("t", b.buffer_set_id, prefix_pages=0, dst_page_indices=[5, 6])
                await kv.send_delta(
                    "t", a.buffer_set_id, src_page_indices=[1, 2], peer_address=server.app.peer_address
                )
                states = {}
                async for st in kv.watch(["t"]):
                    states[st.role] = st.state
                    if len(states) == 2 and all(s in ("DONE", "FAILED", "ABORTED") for s in states.values()):
                        break
                assert states == {"SENDER": "DONE", "RECEIVER": "DONE"}
                assert (dst.k(0)[[5, 6]] == 7).all() and (dst.v(1)[[5, 6]] == 9).all()
                assert (dst.k(0)[[0, 1, 2, 3, 4, 7]] == 0).all()
                with pytest.raises(InvalidArgument, match="src_page_indices"):
                    await kv.send_delta("u", a.buffer_set_id, src_page_indices=[99], peer_address="x")
                with pytest.raises(NotFound):
                    await kv.unregister_buffers("bs-missing")

    asyncio.run(main())
