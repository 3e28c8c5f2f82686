"""The vLLM connector's own tests (clients/vllm/tests), run in .venv-vllm where vLLM is."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.services import ServiceProc

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_connector_unit_tests_pass_in_the_vllm_venv() -> None:
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-vllm-cpu.sh)")
    svc = ServiceProc("vllm-units")  # for the worker side's TP test
    try:
        svc.wait_ready()
        r = subprocess.run(
            [str(VLLM_PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
            cwd=ROOT / "clients" / "vllm",
            env=dict(os.environ, KVS_TEST_SERVICE=svc.address),
            capture_output=True,
            text=True,
            timeout=580,
        )
    finally:
        svc.stop()
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0 and " passed" in r.stdout and "failed" not in r.stdout, tail
    assert "skipped" not in r.stdout, tail
