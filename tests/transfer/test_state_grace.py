"""An ended transfer's working state goes soon; its records stay for Poll (ends.STATE_GRACE_S).

Kept as long as the records (``transfer_retain_s``, 300 s), every side's Outgoing / Incoming with
its task and plans made the cyclic GC walk millions of objects at a few thousand transfers/s.
"""

from __future__ import annotations

from typing import Any

import pytest
from kvservice_client import Layout

from kvservice.transfer import ends
from tests.support.poll import eventually
from tests.support.transfers import one

LAYOUT = Layout.mha(num_layers=1, page_size=4, num_pages=16, total_kv_heads=2, head_dim=8, dtype="float16")


@pytest.mark.parametrize("path", ["auto", "packed"])
def test_ended_sides_drop_their_state_and_keep_their_records(
    monkeypatch: Any, make_server: Any, make_pool: Any, make_client: Any, path: str
) -> None:
    monkeypatch.setattr(ends, "STATE_GRACE_S", 0.0)
    srv = make_server(transport="loopback")
    pa, pb = make_pool(LAYOUT), make_pool(LAYOUT)
    ka, kb = make_client(srv), make_client(srv)
    a = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
    b = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
    kb.expect_delta("g1", b, prefix_pages=0, dst_page_indices=[1, 2])
    ka.send_delta("g1", a, src_page_indices=[3, 4], peer_address=srv.app.peer_address, path=path)
    assert one(kb, "g1").state == "DONE" and one(ka, "g1").state == "DONE"
    engine = srv.app.node.transfers
    # the reaper drops it within about a second
    eventually(
        lambda: not engine.sender.of("g1") and not engine.receiver.of("g1"),
        5.0,
        "working state dropped",
        0.05,
    )
    (r,) = kb.poll(["g1"])  # the records still answer
    assert r.state == "DONE" and r.pages_sent == 2
    assert [s.state for s in kb.abort("g1")] == ["DONE"]  # an abort of it: its record, unchanged
    assert one(kb, "g1").state == "DONE"
