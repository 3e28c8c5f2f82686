"""The Go router client (clients/go) against a live service: `go test` run from here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_go_client_matches_leases_watches_against_a_live_service() -> None:
    """`go test ./...` in clients/go: MatchPrefix picks the longest prefix, leases, watch, health."""
    go = shutil.which("go")
    if go is None:
        if os.environ.get("CI"):
            pytest.fail("Go is required in CI for the router client test")
        pytest.skip("Go is not installed")
    env = {
        **os.environ,
        "KVCLIENT_TEST_SERVICE": str(Path(sys.executable).with_name("kvservice")),
        "KVSERVICE_TRANSFER_INTEGRITY": "1",  # the services it starts inherit it: on in tests
    }
    r = subprocess.run(
        [go, "test", "-count=1", "-v", "./..."],
        cwd=ROOT / "clients" / "go", env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "--- PASS: TestRouterPicksTheDecodeEngineWithTheLongestPrefix" in r.stdout
    assert "--- PASS: TestRouterOverTCPNeedsTheBearerToken" in r.stdout  # token refused/accepted
    assert "--- PASS: TestRouterOverMutualTLS" in r.stdout
    assert "--- PASS: TestRouterSeesAndClaimsALandedTransfer" in r.stdout  # landing: see, claim
