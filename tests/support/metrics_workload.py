"""A bounded transfer workload between two in-process services, for the metrics tests.

``run_workload(a, b, seconds)`` drives real transfers from service ``a`` to ``b`` through the
client SDK (loopback transport, POSIX-shm pools) until ``seconds`` pass: direct, packed and
auto paths with a held prefix, index publishes and MatchPrefix hits; and once each a deadline
failure, an abort and a NOT_FOUND call, so every metric family gets samples.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
from kvservice_client import Client, KVClientError, Layout, ShmKVPool

__all__ = ["LAYOUT", "run_workload"]

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=64, total_kv_heads=2, head_dim=8, dtype="float16")


def _failures(kb: Client, bs_b: str) -> None:
    kb.expect_delta("wl-deadline", bs_b, prefix_pages=0, dst_page_indices=[60], deadline_ms=100)
    kb.expect_delta("wl-abort", bs_b, prefix_pages=0, dst_page_indices=[61])
    kb.abort("wl-abort", reason="workload abort")
    try:
        kb.abort("wl-no-such-transfer")
    except KVClientError:
        pass  # NOT_FOUND is the point: an RPC error for the per-code panel


def run_workload(a: Any, b: Any, seconds: float) -> int:
    """Run transfers a → b for ``seconds`` (bounded); returns how many completed DONE."""
    pa, pb = ShmKVPool.create(LAYOUT), ShmKVPool.create(LAYOUT)
    rng = np.random.default_rng(0)
    for layer in range(LAYOUT.num_layers):
        pa.k(layer)[:] = rng.integers(0, 255, pa.k(layer).shape, dtype=np.uint8)
        pa.v(layer)[:] = rng.integers(0, 255, pa.v(layer).shape, dtype=np.uint8)
    done = 0
    try:
        with Client(a.address) as ka, Client(b.address) as kb:
            bs_a = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
            bs_b = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
            tokens = rng.integers(0, 32000, 8 * LAYOUT.page_size).tolist()
            kb.publish_pages(bs_b, list(range(40, 48)), tokens=tokens)
            _failures(kb, bs_b)
            end = time.monotonic() + seconds
            for i in itertools.count():
                if time.monotonic() > end:
                    break
                tid, path = f"wl-{i}", ("direct", "packed", "auto")[i % 3]
                prefix = i % 4  # pages 0..prefix-1 of the sequence are held by b already
                src = list(range(8 * (i % 4), 8 * (i % 4) + 8))
                kb.match_prefix(tokens=tokens[: (prefix + 2) * LAYOUT.page_size], page_size=LAYOUT.page_size)
                kb.expect_delta(
                    tid, bs_b, prefix_pages=prefix, dst_page_indices=list(range(32, 32 + 8 - prefix))
                )
                ka.send_delta(tid, bs_a, src_page_indices=src, peer_address=b.app.peer_address, path=path)
                (rb,) = kb.wait(tid, timeout=10)
                (ra,) = ka.wait(tid, timeout=10)
                done += rb.state == ra.state == "DONE"
                time.sleep(0.05)  # spread samples over scrapes
    finally:
        pa.close()
        pb.close()
    return done
