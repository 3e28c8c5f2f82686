"""Routing support: transfer load in MatchPrefix / GetStats, and inbound budgets on ExpectDelta."""

from __future__ import annotations

import shutil
import subprocess
import time

import numpy as np
import pytest
from kvservice_client import Client, Layout, ResourceExhausted, ShmKVPool

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=32, total_kv_heads=2, head_dim=8, dtype="float16")
PAGE_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # layers x (K, V) x tokens x heads x head_dim x itemsize
BUDGET = 3 * PAGE_BYTES
TOKENS = np.arange(1000, 1000 + 8 * 4)


def _load(client: Client, bs_id: str):  # noqa: ANN202
    (m,) = client.match_prefix(tokens=TOKENS, page_size=4, buffer_set_ids=[bs_id]).matches
    return m.load


def test_transfer_budget_refuses_at_once_and_recovers(make_server) -> None:
    srv = make_server(transport="loopback", inbound_max_transfers=2)
    with ShmKVPool.create(LAYOUT) as pool, Client(srv.address) as kc:
        bs = kc.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        kc.expect_delta("a", bs, prefix_pages=0, dst_page_indices=[0, 1])
        kc.expect_delta("b", bs, prefix_pages=0, dst_page_indices=[2])
        ld = _load(kc, bs)
        assert (ld.inbound_transfers, ld.inbound_max_transfers, ld.admits) == (2, 2, False)
        assert ld.inbound_bytes_pending == 3 * PAGE_BYTES
        t0 = time.perf_counter()
        with pytest.raises(
            ResourceExhausted, match=r"inbound_max_transfers: .* 2 unfinished inbound .* budget is 2"
        ):
            kc.expect_delta("c", bs, prefix_pages=0, dst_page_indices=[3])
        assert time.perf_counter() - t0 < 2.0  # refused at once, not queued into a timeout
        assert kc.poll(["c"]) == []  # the refused call changed nothing
        assert _load(kc, bs).inbound_refused == 1
        kc.abort("a")  # a slot frees: the next ExpectDelta is admitted
        assert _load(kc, bs).admits
        kc.expect_delta("c", bs, prefix_pages=0, dst_page_indices=[3])
        assert [s.state for s in kc.poll(["c"])] == ["PENDING"]
        assert _load(kc, bs).inbound_transfers == 2


def test_engine_overrides_the_default_budget_and_bytes_budget(make_server) -> None:
    srv = make_server(transport="loopback", inbound_max_transfers=8)
    with ShmKVPool.create(LAYOUT) as pool, Client(srv.address) as kc:
        bs = kc.register_buffers(
            LAYOUT,
            pool.k_regions,
            pool.v_regions,
            inbound_max_transfers=100,
            inbound_max_bytes=3 * PAGE_BYTES,
        ).buffer_set_id
        # Alone, a transfer larger than the byte budget is admitted (never refused forever).
        kc.expect_delta("big", bs, prefix_pages=0, dst_page_indices=[0, 1, 2, 3])
        with pytest.raises(
            ResourceExhausted, match=rf"inbound_max_bytes: .* {4 * PAGE_BYTES} bytes still to arrive"
        ):
            kc.expect_delta("x", bs, prefix_pages=0, dst_page_indices=[4])
        kc.abort("big")
        kc.expect_delta("two", bs, prefix_pages=0, dst_page_indices=[4, 5])
        kc.expect_delta("one", bs, prefix_pages=0, dst_page_indices=[6])  # 3 pages: at the budget
        with pytest.raises(ResourceExhausted, match="inbound_max_bytes"):
            kc.expect_delta("more", bs, prefix_pages=0, dst_page_indices=[7])
        ld = _load(kc, bs)
        assert (ld.inbound_max_transfers, ld.inbound_max_bytes, ld.inbound_refused) == (
            100,
            3 * PAGE_BYTES,
            2,
        )
        assert ld.inbound_bytes_pending == 3 * PAGE_BYTES and not ld.admits


def test_load_equals_what_stats_and_transfers_say(make_server) -> None:
    a, b = make_server(transport="loopback"), make_server(transport="loopback")
    with (
        ShmKVPool.create(LAYOUT) as pa,
        ShmKVPool.create(LAYOUT) as pb,
        Client(a.address) as ka,
        Client(b.address) as kb,
    ):
        sa = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
        sb = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
        ld = _load(kb, sb)
        assert (ld.inbound_transfers, ld.inbound_samples, ld.inbound_p50_us, ld.admits) == (0, 0, 0, True)
        for i in range(3):
            kb.expect_delta(f"t{i}", sb, prefix_pages=0, dst_page_indices=[3 * i, 3 * i + 1, 3 * i + 2])
            ka.send_delta(f"t{i}", sa, src_page_indices=[0, 1, 2], peer_address=b.app.peer_address)
            assert {s.state for s in kb.wait(f"t{i}", timeout=20)} == {"DONE"}
        kb.expect_delta("pending", sb, prefix_pages=0, dst_page_indices=[20, 21])
        # A sender whose receiver has not declared yet is outbound in flight on its side.
        ka.send_delta("later", sa, src_page_indices=[0], peer_address=b.app.peer_address, deadline_ms=30_000)
        ld = _load(kb, sb)
        live = [s for s in kb.poll() if not s.terminal]
        assert ld.inbound_transfers == len(live) == 1
        assert ld.inbound_bytes_pending == 2 * PAGE_BYTES
        done = [s for s in kb.poll() if s.state == "DONE"]
        totals = sorted(s.timings_us["total"] for s in done)
        assert ld.inbound_samples == 3
        assert totals[0] <= ld.inbound_p50_us <= totals[-1] and ld.inbound_p99_us <= totals[-1] + 1
        assert _load(ka, sa).outbound_transfers == 1
        (info,) = [i for i in kb.get_stats().buffer_sets if i.buffer_set_id == sb]
        assert (info.load.inbound_transfers, info.load.inbound_bytes_pending, info.load.inbound_samples) == (
            1,
            2 * PAGE_BYTES,
            3,
        )
        ka.abort("later")
        kb.abort("pending")
        assert _load(kb, sb).inbound_transfers == 0 and _load(ka, sa).outbound_transfers == 0


def test_engine_gauges_and_refusal_counter(make_server) -> None:
    srv = make_server(transport="loopback", inbound_max_transfers=1)
    with ShmKVPool.create(LAYOUT) as pool, Client(srv.address) as kc:
        bs = kc.register_buffers(LAYOUT, pool.k_regions, pool.v_regions, engine_id="decode-7").buffer_set_id
        kc.expect_delta("a", bs, prefix_pages=0, dst_page_indices=[0, 1])
        with pytest.raises(ResourceExhausted):
            kc.expect_delta("b", bs, prefix_pages=0, dst_page_indices=[2])
        text = srv.app.metrics.exposition().decode()
        assert 'kvservice_engine_inbound_transfers{engine="decode-7"} 1.0' in text
        assert f'kvservice_engine_inbound_bytes_pending{{engine="decode-7"}} {2 * PAGE_BYTES}.0' in text
        assert 'kvservice_engine_inbound_budget_transfers{engine="decode-7"} 1.0' in text
        assert 'kvservice_admission_refused_total{budget="inbound_max_transfers"} 1.0' in text
        promtool = shutil.which("promtool")
        if promtool:  # the real Prometheus linter, on the exposition with these series in it
            check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr
        kc.unregister_buffers(bs)
        assert 'engine="decode-7"' not in srv.app.metrics.exposition().decode()  # bounded label set
