"""End-to-end integrity across service processes on CPU: two ``kvservice`` processes
over NIXL (UCX on DRAM, the cross-node route), shm pools in engine processes; a packed batch
corrupted after the sender's xxh3 (tests/support/faulty_service.py) fails the transfer and changes no
page, the retry lands byte-exact. tests/gpu/test_gpu_integrity.py runs the same on VRAM pools."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvservice_client import Layout

from kvservice.transfer.nixl_transport import nixl_available
from tests.support.integrity_procs import ShmSide, corrupted_then_clean
from tests.support.services import FAULTY_LAUNCHER, ServiceProc

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=64, total_kv_heads=2, head_dim=16, dtype="bfloat16")


def test_a_batch_corrupted_in_transit_fails_and_the_retry_lands(tmp_path: Path) -> None:
    trigger = tmp_path / "corrupt"
    fault = {"KVS_TEST_CORRUPT_PACKED": str(trigger)}
    svcs = [ServiceProc(n, "--same-host-route", "off", launcher=FAULTY_LAUNCHER, env=fault) for n in "ab"]
    sides: list[ShmSide] = []
    try:
        for s in svcs:
            s.wait_ready()
        sides.append(ShmSide(svcs[0].address, LAYOUT, seed=1))
        sides.append(ShmSide(svcs[1].address, LAYOUT, seed=2))
        src_pages, dst_pages = list(range(0, 48, 2)), list(range(63, 39, -1))
        corrupted_then_clean(sides[0], sides[1], svcs[1].address, trigger, src_pages, dst_pages, 64)
    finally:
        for side in sides:
            side.close()
        for s in svcs:
            s.stop()
