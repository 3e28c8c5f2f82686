"""GPU: an Abort during a large VRAM transfer, and a service stopped with transfers in flight
(data path v3: completion threads and pollers). Engines in their own processes, pools through
CUDA IPC, two kvservice processes talking over NIXL (the cross-node route) or one (fused)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.support.gpu import Engine, kvservice_procs

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
# 32 layers x K/V x 512 pages x 32 KiB: 1 GiB per engine; a 384-page delta is 768 MiB, tens of ms
BIG = dict(num_layers=32, page_size=16, num_pages=512, total_kv_heads=8, head_dim=128, dtype="bfloat16")
SRC, DST = list(range(0, 384)), list(range(128, 512))
CANARIES = list(range(0, 128))  # never named by the receiver: must stay zero whatever happens


@pytest.fixture
def two(tmp_path: Path):
    procs, socks = kvservice_procs(tmp_path, ("a", "b"))
    yield procs, socks
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        p.wait(30)


@pytest.fixture
def one(tmp_path: Path):
    procs, socks = kvservice_procs(tmp_path, ("a",))
    yield socks[0]
    procs[0].terminate()
    procs[0].wait(30)


def _engines(src_addr: str, dst_addr: str) -> tuple[Engine, Engine]:
    src, dst = Engine(), Engine()
    src(op="register", address=src_addr, layout=BIG, fill=True, seed=7)
    dst(op="register", address=dst_addr, layout=BIG)
    return src, dst


def _abort_midway(src: Engine, dst: Engine, peer: str, tid: str, path: str) -> tuple[dict, dict]:
    assert dst(op="expect", tid=tid, prefix=0, dst=DST)["ok"]
    assert src(op="send", tid=tid, src=SRC, peer=peer, path=path)["ok"]
    dst(op="abort", tid=tid)  # returns once no byte can land any more
    after_abort = dst(op="pages", pages=DST)["sums"]
    time.sleep(0.5)
    assert dst(op="pages", pages=DST)["sums"] == after_abort, "bytes landed after Abort returned"
    assert all(s == 0 for region in dst(op="pages", pages=CANARIES)["sums"] for s in region)
    return src(op="wait", tid=tid, timeout=30), dst(op="wait", tid=tid, timeout=30)


def test_abort_during_a_large_cross_node_transfer(two) -> None:
    """The receiver aborts a 768 MiB VRAM delta while it moves: both sides end ABORTED, nothing
    lands after the Abort returned, pages never named stay untouched."""
    _, (a, b) = two
    src, dst = _engines(a, b)
    try:
        got_s, got_d = _abort_midway(src, dst, b, "abort-x", "auto")
        assert got_d["state"] == "ABORTED", got_d
        assert got_s["state"] in ("ABORTED", "FAILED"), got_s
    finally:
        src.close()
        dst.close()


def test_abort_during_a_fused_same_node_transfer(one) -> None:
    """Same node (one service, fused copy): an Abort waits for a copy in progress; afterwards no
    byte lands and the canaries are untouched (a copy that finished first ends DONE, whole)."""
    src, dst = _engines(one, one)
    try:
        got_s, got_d = _abort_midway(src, dst, one, "abort-f", "auto")
        assert got_d["state"] in ("ABORTED", "DONE"), got_d
        if got_d["state"] == "DONE":
            assert dst(op="pages", pages=DST)["sums"] == src(op="pages", pages=SRC)["sums"]
    finally:
        src.close()
        dst.close()


def test_a_sender_service_stopped_mid_transfer_exits_and_the_receiver_fails(two) -> None:
    """SIGTERM to the sending service while a large transfer is in flight: it exits promptly (its
    CUDA completion threads and NIXL pollers stop), the receiver's side ends FAILED or ABORTED
    within its deadline, and the receiver's canary pages are untouched."""
    (pa, _), (a, b) = two
    src, dst = _engines(a, b)
    try:
        assert dst(op="expect", tid="stop-x", prefix=0, dst=DST, deadline_ms=20_000)["ok"]
        assert src(op="send", tid="stop-x", src=SRC, peer=b, path="auto")["ok"]
        time.sleep(0.005)
        t0 = time.monotonic()
        pa.send_signal(signal.SIGTERM)
        pa.wait(30)
        assert time.monotonic() - t0 < 30
        got_d = dst(op="wait", tid="stop-x", timeout=30)
        assert got_d["state"] in ("FAILED", "ABORTED", "DONE"), got_d
        assert all(s == 0 for region in dst(op="pages", pages=CANARIES)["sums"] for s in region)
    finally:
        try:
            src.close()
        except Exception:
            pass
        dst.close()
