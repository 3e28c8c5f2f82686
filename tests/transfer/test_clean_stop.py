"""A service stops cleanly: its peer channels end before its servers stop, with no warning, no
ERROR record and no traceback on either side, whichever of two services stops first."""

from __future__ import annotations

import re

import pytest
from kvservice_client import Client, Layout, ShmKVPool

from tests.support.services import ServiceProc

LAYOUT = Layout.mha(num_layers=2, page_size=16, num_pages=64, total_kv_heads=2, head_dim=64, dtype="bfloat16")
NOISE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")


@pytest.mark.parametrize("order", ["receiver first", "sender first", "together"])
def test_stop_after_a_transfer_logs_nothing_wrong(order: str) -> None:
    """Transfers over the peer channel, then SIGTERM: both services exit 0 and log nothing at WARNING+."""
    flags = ("--same-host-route", "off", "--peer-allowlist", "unix")
    sender, receiver = ServiceProc("stop-a", *flags), ServiceProc("stop-b", *flags)
    pools = [ShmKVPool.create(LAYOUT), ShmKVPool.create(LAYOUT)]
    try:
        sender.wait_ready()
        receiver.wait_ready()
        with Client(sender.address) as ka, Client(receiver.address) as kb:
            a = ka.register_buffers(LAYOUT, pools[0].k_regions, pools[0].v_regions).buffer_set_id
            b = kb.register_buffers(LAYOUT, pools[1].k_regions, pools[1].v_regions).buffer_set_id
            for tid, path in (("stop-direct", "direct"), ("stop-packed", "packed")):
                kb.expect_delta(tid, b, prefix_pages=0, dst_page_indices=list(range(20)), deadline_ms=20_000)
                ka.send_delta(
                    tid, a, src_page_indices=list(range(20)), peer_address=receiver.address, path=path
                )
                assert [s.state for s in ka.wait(tid, timeout=20) + kb.wait(tid, timeout=20)] == ["DONE"] * 2
            # the engines stay connected: the services stop under live sessions and channels
            first = {"receiver first": [receiver], "sender first": [sender]}.get(order, [sender, receiver])
            for svc in first:
                svc.signal(15)
            for svc in first:
                assert svc.proc.wait(30) == 0, svc.output()
        for svc in (sender, receiver):
            svc.signal(15)
            assert svc.proc.wait(30) == 0, svc.output()
        for svc in (sender, receiver):
            noise = [line for line in svc.output().splitlines() if NOISE.search(line)]
            assert not noise, svc.output()
    finally:
        for svc in (sender, receiver):
            svc.stop()
        for pool in pools:
            pool.close()
