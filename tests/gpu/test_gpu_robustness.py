"""GPU: an engine's memory going away never takes the service down. An engine that frees its
CUDA pool while registered, or dies in the middle of a transfer, ends (at most) its own
transfers; the service keeps serving every other engine byte for byte. Aux rows in VRAM are
refused at RegisterBuffers naming the field."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.gpu import LAYOUT, Engine, kvservice_procs, wait_lanes

pytestmark = pytest.mark.gpu
BIG = dict(LAYOUT, num_pages=1024)  # 3 layers x 1024 pages x 32 KiB x 2: 192 MiB a pool


@pytest.fixture
def service(tmp_path: Path):
    procs, socks = kvservice_procs(tmp_path, ("a",), KVSERVICE_TRANSFER_INTEGRITY="0")
    wait_lanes(socks[:1])
    yield socks[0], procs[0]
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(20)


def _bystanders_move(address: str) -> None:
    """Another pair of engines on the same service: a transfer lands byte for byte."""
    src, dst = Engine(), Engine()
    try:
        src(op="register", address=address, layout=LAYOUT, fill=True, seed=11)
        dst(op="register", address=address, layout=LAYOUT)
        dst(op="expect", tid="bystander", prefix=0, dst=[4, 5, 6])
        src(op="send", tid="bystander", src=[1, 2, 3], peer=address)
        assert dst(op="wait", tid="bystander")["state"] == "DONE"
        assert src(op="digest", pages=[1, 2, 3])["digests"] == dst(op="digest", pages=[4, 5, 6])["digests"]
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("who", ["receiver", "sender"])
def test_an_engine_freeing_its_pool_ends_only_its_transfers(service: tuple[str, object], who: str) -> None:
    """The engine frees its registered pool, then a transfer touches it: the service lives."""
    address, proc = service
    src, dst = Engine(), Engine()
    try:
        src(op="register", address=address, layout=BIG, fill=True, seed=5)
        dst(op="register", address=address, layout=BIG)
        dst(op="expect", tid="t1", prefix=0, dst=list(range(512, 1024)))
        (dst if who == "receiver" else src)(op="free")
        src(op="send", tid="t1", src=list(range(512)), peer=address)
        got = dst(op="wait", tid="t1", timeout=30)
        assert got["state"] in ("DONE", "FAILED"), got  # it ends, within its deadline
        assert proc.poll() is None, "the service died"  # type: ignore[attr-defined]
        _bystanders_move(address)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("who", ["receiver", "sender"])
def test_an_engine_killed_mid_transfer_ends_only_its_transfers(service: tuple[str, object], who: str) -> None:
    """SIGKILL of one engine while its 96 MiB transfer is copied: the other engine's side ends
    (FAILED or ABORTED, or DONE when the copy won), the service keeps serving."""
    address, proc = service
    src, dst = Engine(), Engine()
    src(op="register", address=address, layout=BIG, fill=True, seed=5)
    dst(op="register", address=address, layout=BIG)
    dst(op="expect", tid="t1", prefix=0, dst=list(range(512, 1024)), deadline_ms=20000)
    send = {"op": "send", "tid": "t1", "src": list(range(512)), "peer": address}
    if who == "sender":  # killed as its SendDelta goes out
        victim, other = src, dst
        assert src.proc.stdin is not None
        src.proc.stdin.write(json.dumps(send) + "\n")
        src.proc.stdin.flush()
        time.sleep(0.005)
    else:  # killed while its pages are being written
        victim, other = dst, src
        src(**send)
    victim.proc.kill()
    victim.proc.wait(10)
    try:
        got = other(op="wait", tid="t1", timeout=30)
        assert got["state"] in ("DONE", "FAILED", "ABORTED"), got
        assert proc.poll() is None, "the service died"  # type: ignore[attr-defined]
        _bystanders_move(address)
    finally:
        other.close()


def test_aux_rows_in_vram_are_refused_naming_aux(service: tuple[str, object]) -> None:
    """A real CUDA aux region: InvalidArgument naming aux_regions[0].region, nothing registered."""
    address, _ = service
    e = Engine()
    try:
        e(op="register", address=address, layout=LAYOUT)
        got = e(op="register_aux_vram")
        assert got["ok"] is False and "InvalidArgument" in got["error"], got
        assert "aux_regions[0].region" in got["error"] and "host memory" in got["error"], got
    finally:
        e.close()
