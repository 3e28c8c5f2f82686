"""A completed ExpectDelta with publish tokens inserts the received sequence into the index."""

from __future__ import annotations

import numpy as np
from kvservice_client import Client, Layout, ShmKVPool

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=32, total_kv_heads=2, head_dim=8, dtype="float16")


def test_received_pages_become_matchable_prefix(make_server) -> None:
    """Turn 2 of a session finds turn 1's pages on the receiver and moves only the new ones."""
    a, b = make_server(transport="loopback"), make_server(transport="loopback")
    with ShmKVPool.create(LAYOUT) as pa, ShmKVPool.create(LAYOUT) as pb:
        for layer in range(2):
            pa.k(layer)[:] = np.arange(32, dtype=np.uint8)[:, None]
        with Client(a.address) as ka, Client(b.address) as kb:
            sa = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
            sb = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
            turn1 = np.arange(100, 100 + 5 * 4)  # 5 pages
            kb.expect_delta(
                "t1", sb, prefix_pages=0, dst_page_indices=[10, 11, 12, 13, 14], publish_tokens=turn1
            )
            ka.send_delta("t1", sa, src_page_indices=[0, 1, 2, 3, 4], peer_address=b.app.peer_address)
            assert {s.state for s in kb.wait("t1", timeout=20)} == {"DONE"}
            turn2 = np.concatenate([turn1, np.arange(7, 7 + 3 * 4)])  # 3 new pages
            m = kb.match_prefix(tokens=turn2, page_size=4, buffer_set_ids=[sb])
            assert m.best.matched_pages == 5 and m.best.page_indices == (10, 11, 12, 13, 14)
            kb.expect_delta(
                "t2",
                sb,
                prefix_pages=5,
                dst_page_indices=[20, 21, 22],
                publish_tokens=turn2,
                prefix_page_indices=m.best.page_indices,
            )
            ka.send_delta(
                "t2", sa, src_page_indices=[0, 1, 2, 3, 4, 5, 6, 7], peer_address=b.app.peer_address
            )
            (st,) = kb.wait("t2", timeout=20)
            assert (st.state, st.pages_sent, st.pages_skipped) == ("DONE", 3, 5)
            assert (pb.k(1)[[20, 21, 22]] == np.array([5, 6, 7], dtype=np.uint8)[:, None]).all()
            assert kb.match_prefix(tokens=turn2, page_size=4, buffer_set_ids=[sb]).best.matched_pages == 8
