"""GPU: mixed tensor parallelism between two kvservice processes (head slices land right)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.gpu import Engine

pytestmark = pytest.mark.gpu
BASE = dict(num_layers=2, page_size=16, num_pages=32, total_kv_heads=8, head_dim=128, dtype="bfloat16")


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2), (4, 2)])
def test_mixed_tp_heads_land_at_their_offsets(services, p: int, d: int) -> None:  # noqa: F811
    """Every receiver head holds exactly the sender head with the same global index."""
    a, b = services
    senders = [Engine() for _ in range(p)]
    receivers = [Engine() for _ in range(d)]
    try:
        for r, e in enumerate(senders):
            e(op="register", address=a, layout={**BASE, "tp_size": p, "tp_rank": r}, fill=True, seed=10 + r)
        for r, e in enumerate(receivers):
            e(op="register", address=b, layout={**BASE, "tp_size": d, "tp_rank": r})
        src, dst = [3, 7, 9, 30], [1, 2, 4, 5]
        tid = f"tp-{p}-{d}"
        for e in receivers:
            assert e(op="expect", tid=tid, prefix=0, dst=dst)["state"] == "PENDING"
        for e in senders:
            e(op="send", tid=tid, src=src, peer=b)
        states = [e(op="wait", tid=tid) for e in senders + receivers]
        assert all(s["state"] == "DONE" for s in states), states
        # global head g of page i: sender rank g // (8/p), local g % (8/p)
        ls, ld = 8 // p, 8 // d
        src_sums = [
            np.array(e(op="head_sums", pages=src)["sums"]) for e in senders
        ]  # [rank][region][page][head]
        dst_sums = [np.array(e(op="head_sums", pages=dst)["sums"]) for e in receivers]
        for g in range(8):
            np.testing.assert_array_equal(dst_sums[g // ld][:, :, g % ld], src_sums[g // ls][:, :, g % ls])
    finally:
        for e in senders + receivers:
            e.close()
