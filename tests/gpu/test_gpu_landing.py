"""GPU: landing transfers into a VRAM landing pool, claimed byte for byte.

Engines are processes with VRAM pools registered through CUDA IPC; services are real
``python -m kvservice`` processes (NIXL). Run on a CUDA machine:

    PYTHONPATH=$PWD:$PWD/clients/python .venv/bin/python -m pytest -q -m gpu tests/gpu/test_gpu_landing.py
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.support.gpu import LAYOUT, Engine

pytestmark = pytest.mark.gpu


def _pools(eng: Engine) -> list[dict]:
    return eng(op="landing_stats")["pools"]


@pytest.mark.parametrize("where", ["cross-node", "same-service"])
def test_landing_in_vram_then_claim(services, where: str) -> None:  # noqa: F811
    """The pages land in the receiver's VRAM landing pool (LANDED, sender DONE), then the claim
    copies them into the named pages: every layer and K/V equal, other pages untouched, pool empty."""
    a, b = services
    src_eng, dst_eng = Engine(), Engine()
    try:
        src_eng(op="register", address=a, layout=LAYOUT, fill=True, seed=5)
        dst_eng(op="register", address=a if where == "same-service" else b, layout=LAYOUT)
        peer = a if where == "same-service" else b
        rng = np.random.default_rng(1)
        src = rng.permutation(64)[:24].tolist()
        dst = rng.permutation(64)[:20].tolist()
        tid = f"gland-{where}"
        assert dst_eng(op="expect_landing", tid=tid, prefix=4, pages=20, ttl_ms=30_000)["state"] == "PENDING"
        assert src_eng(op="send", tid=tid, src=src, peer=peer)["ok"]
        got = dst_eng(op="wait_landed", tid=tid)
        assert got["state"] == "LANDED", got
        assert src_eng(op="wait", tid=tid)["state"] == "DONE"
        (pool,) = _pools(dst_eng)
        assert pool["location"] == "vram:0" and pool["landings"] == 1 and pool["used"] > 0, pool
        assert all(s == 0 for region in dst_eng(op="pages", pages=dst)["sums"] for s in region)  # not yet
        c = dst_eng(op="claim", tid=tid, dst=dst)
        assert c["ok"] and c["state"] == "DONE", c
        assert dst_eng(op="pages", pages=dst)["sums"] == src_eng(op="pages", pages=src[4:])["sums"]
        untouched = sorted(set(range(64)) - set(dst))
        assert all(s == 0 for region in dst_eng(op="pages", pages=untouched)["sums"] for s in region)
        (pool,) = _pools(dst_eng)
        assert pool["used"] == 0 and pool["landings"] == 0 and pool["claims"] == 1, pool
    finally:
        src_eng.close()
        dst_eng.close()


def test_vram_landing_expires_and_frees(services) -> None:  # noqa: F811
    """Unclaimed past its TTL: FAILED with 'landing expired', the VRAM freed, a claim says why."""
    a, b = services
    src_eng, dst_eng = Engine(), Engine()
    try:
        src_eng(op="register", address=a, layout=LAYOUT, fill=True, seed=6)
        dst_eng(op="register", address=b, layout=LAYOUT)
        dst_eng(op="expect_landing", tid="gexp", pages=8, ttl_ms=300)
        src_eng(op="send", tid="gexp", src=list(range(8)), peer=b)
        assert dst_eng(op="wait_landed", tid="gexp")["state"] == "LANDED"
        time.sleep(1.0)
        c = dst_eng(op="claim", tid="gexp", dst=list(range(8)))
        assert not c["ok"] and "landing expired" in c["error"], c
        (pool,) = _pools(dst_eng)
        assert pool["used"] == 0 and pool["landings"] == 0, pool
        assert all(s == 0 for region in dst_eng(op="pages", pages=list(range(64)))["sums"] for s in region)
    finally:
        src_eng.close()
        dst_eng.close()
