"""The load/soak run at CI size: bench/soak.py with 1,500 transfers, 150 in flight, between two
service processes; every transfer checked byte for byte. The long run (100,000 transfers, 1,000
in flight) is ``python bench/soak.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.transfer.nixl_transport import nixl_available

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]


@pytest.mark.timeout(280)
def test_short_soak_loses_and_corrupts_nothing(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients/python")]),
        "KVSERVICE_TRANSFER_INTEGRITY": "1",  # its services inherit it: on in tests
    }
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--total", "1500", "--inflight", "150",
         "--sample-s", "1", "--warmup", "0.3", "--out", str(tmp_path), "--name", "soak"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=260,
    )  # fmt: skip
    assert (tmp_path / "soak.json").exists(), run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["outcomes"] == {"ok": 1500}, report["failure_reasons"]
    assert (report["lost"], report["corrupted"]) == (0, 0)
    drift, slack = report["after_warmup_drift"], report["slack"]
    for i in range(2):  # after the warm-up neither service grows: no descriptor or memory leak
        assert drift[f"fds_{i}"] <= slack["fds"], drift
        assert drift[f"rss_mb_{i}"] <= slack["rss_mb"], drift
    assert report["rss_fd_flat"] and run.returncode == 0, run.stderr[-2000:]
