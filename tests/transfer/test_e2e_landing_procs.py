"""Landing across processes (NIXL over UCX on DRAM): the parties of a landed transfer die.

    engine A ─UDS─▶ service P ═NIXL═▶ service D (landing pool) ◀─UDS─ engines B, V

* the sender's service is SIGKILLed after LANDED: the landed pages and aux rows (written over NIXL
  into the landing pool's host rows) stay, B claims them intact;
* the claiming engine V is SIGKILLed before it claims: its session's grace passes, the landing
  ends ABORTED and every landing byte is free again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvservice_client import Layout

from tests.support.engines import EngineProc
from tests.support.poll import eventually
from tests.support.pools import assert_pages_equal
from tests.support.services import ServiceProc, admin_stats

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=64, total_kv_heads=2, head_dim=16, dtype="bfloat16")
AUX = {"meta": (64, 8)}  # name -> (row bytes, rows)


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Any]]:
    svc = {
        "P": ServiceProc("land-P", "--same-host-route", "off"),
        "D": ServiceProc("land-D", "--same-host-route", "off", "--session-grace-s", "1"),
    }
    eng: dict[str, EngineProc] = {}
    try:
        for s in svc.values():
            s.wait_ready()
        eng = {
            "A": EngineProc(svc["P"].address, LAYOUT, AUX, seed=1),
            "B": EngineProc(svc["D"].address, LAYOUT, AUX, seed=2),
        }
        eng["V"] = EngineProc(svc["D"].address, LAYOUT, seed=3)
        for e in eng.values():
            e.ready()
        yield {"svc": svc, "eng": eng}
    finally:
        for e in eng.values():
            e.stop()
        for s in svc.values():
            s.stop()


def landing_of(svc: ServiceProc) -> tuple[int, int]:
    """(bytes, landings) held in the service's landing pools now."""
    st = admin_stats(svc.address).landing
    return sum(x.used_bytes for x in st), sum(x.landings for x in st)


def landed(eng: EngineProc, tid: str) -> Any:
    def state() -> Any:
        sts = eng.call("poll", [tid])
        return sts[0] if sts and sts[0].state in ("LANDED", "DONE", "FAILED", "ABORTED") else None

    return eventually(state, 15, f"{tid} landed")


def test_claiming_engine_killed_before_claiming(nodes) -> None:
    """V declares a landing, it lands, V is SIGKILLed: within its session grace the landing is
    ABORTED and its bytes are free (no claim ever comes)."""
    a, v = nodes["eng"]["A"], nodes["eng"]["V"]
    d = nodes["svc"]["D"]
    v.call("expect_landing", "k-claimer", v.bs, pages=6, ttl_ms=60_000)
    a.call("send_delta", "k-claimer", a.bs, src_page_indices=list(range(6)), peer_address=d.address)
    assert landed(v, "k-claimer").state == "LANDED"
    assert landing_of(d)[1] == 1
    name = v.pool.name if v.pool is not None else ""
    v.proc.kill()
    v.proc.join(5)
    t0 = time.monotonic()
    eventually(lambda: landing_of(d) == (0, 0), 10, "the dead claimer's landing freed")
    assert time.monotonic() - t0 < 6.0  # the session grace (1 s) and the release, not the 60 s TTL
    if name:
        try:
            os.unlink(f"/dev/shm/{name.lstrip('/')}")  # the killed engine never unlinked its pool
        except FileNotFoundError:
            pass


def test_sender_service_killed_after_landed(nodes) -> None:
    """LANDED, then the sender's service is SIGKILLed: the landing stays (no UNAVAILABLE), and the
    claim copies the sender's bytes intact, pages and aux row."""
    a, b = nodes["eng"]["A"], nodes["eng"]["B"]
    p, d = nodes["svc"]["P"], nodes["svc"]["D"]
    src = [3, 8, 1, 40, 41]
    b.call("expect_landing", "k-sender", b.bs, pages=len(src), ttl_ms=60_000, aux={"meta": 1})
    a.call(
        "send_delta", "k-sender", a.bs, src_page_indices=src, peer_address=d.address, path="packed",
        aux={"meta": [6]},
    )  # fmt: skip
    assert landed(b, "k-sender").state == "LANDED"
    p.kill()
    time.sleep(1.5)  # past the dead-peer detection (about a second)
    (r,) = b.call("poll", ["k-sender"])
    assert r.state == "LANDED", r
    dst = [10, 11, 12, 13, 14]
    c = b.call("claim", "k-sender", b.bs, dst_page_indices=dst, aux={"meta": [2]})
    assert c.status.state == "DONE", c
    assert_pages_equal(b.pool, dst, a.pool, src)
    assert (b.pool.aux("meta")[2] == a.pool.aux("meta")[6]).all()
    assert landing_of(d) == (0, 0)
