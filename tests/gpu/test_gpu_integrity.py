"""GPU: end-to-end integrity between two kvservice processes over NIXL, VRAM pools from
engine processes (CUDA IPC), VRAM staging and the device checksum (wsum64) gating the receiver's
unpack. A packed staging batch corrupted after the sender's checksum (tests/support/faulty_service.py)
FAILS the transfer naming the checksum and changes no destination page; with the fault gone, the
retry is DONE and byte-exact. tests/transfer/test_integrity_procs.py runs the same on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gpu import LAYOUT, Engine, kvservice_procs
from tests.support.integrity_procs import corrupted_then_clean
from tests.support.services import FAULTY_SERVICE as FAULTY

pytestmark = pytest.mark.gpu


class VramSide:
    """An engine process with a VRAM pool (gpu_engine.py) registered with the service at ``address``."""

    def __init__(self, address: str, seed: int, fill: bool) -> None:
        self.eng = Engine()
        self.eng(op="register", address=address, layout=LAYOUT, fill=fill, seed=seed)

    def expect(self, tid: str, dst: list[int]) -> None:
        assert self.eng(op="expect", tid=tid, prefix=0, dst=dst, deadline_ms=20_000)["ok"]

    def send(self, tid: str, src: list[int], peer: str) -> None:
        assert self.eng(op="send", tid=tid, src=src, peer=peer, path="packed")["ok"]

    def wait(self, tid: str) -> tuple[str, str]:
        got = self.eng(op="wait", tid=tid, timeout=60)
        return got["state"], got["error"]

    def digests(self, pages: list[int]) -> list[str]:
        return self.eng(op="digest", pages=pages)["digests"]

    def close(self) -> None:
        self.eng.close()


@pytest.fixture
def services(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """Two services with integrity on (kvservice_procs' default), the cross-node route, launched
    by faulty_service.py; and the fault's trigger file (absent: no fault)."""
    trigger = tmp_path / "corrupt"
    procs, (a, b) = kvservice_procs(
        tmp_path,
        ("a", "b"),
        launcher=(str(FAULTY),),
        KVSERVICE_SAME_HOST_ROUTE="off",
        KVS_TEST_CORRUPT_PACKED=str(trigger),
    )
    yield a, b, trigger
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(20)


def test_a_vram_batch_corrupted_in_transit_fails_and_the_retry_lands(services) -> None:
    a, b, trigger = services
    src, dst = VramSide(a, seed=1, fill=True), VramSide(b, seed=2, fill=True)
    try:
        src_pages, dst_pages = list(range(0, 48, 2)), list(range(63, 39, -1))
        corrupted_then_clean(src, dst, b, trigger, src_pages, dst_pages, LAYOUT["num_pages"])
    finally:
        src.close()
        dst.close()
