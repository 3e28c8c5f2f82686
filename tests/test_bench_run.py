"""bench/run.py's steps: what a step's processes see (its environment under MPS)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("run")


def test_a_step_under_mps_runs_with_the_daemons_pipe_directory(
    run: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """The MPS pipe directory set when the step starts reaches its processes (without it they make
    contexts of their own: no MPS), and the steps after it run without."""
    from suites import Step, Suite

    def fake_mps(on: bool) -> None:  # nvidia-cuda-mps-control's part: the environment it leaves
        if on:
            os.environ["CUDA_MPS_PIPE_DIRECTORY"] = str(tmp_path / "mps")
        else:
            os.environ.pop("CUDA_MPS_PIPE_DIRECTORY", None)

    monkeypatch.setattr(run, "_mps", fake_mps)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(run, "HERE", tmp_path)
    (tmp_path / "probe.py").write_text(
        "import json, os, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "os.makedirs(out, exist_ok=True)\n"
        "json.dump({'pipe': os.environ.get('CUDA_MPS_PIPE_DIRECTORY', '')}, open(out + '/r.json', 'w'))\n"
    )
    suite = Suite("t", "test", (Step("shared", ("probe.py",), mps=True), Step("alone", ("probe.py",))), ())
    runs = run.run_steps(suite, False, tmp_path / "work")
    assert runs["shared"]["pipe"] == str(tmp_path / "mps"), runs
    assert runs["alone"]["pipe"] == "", runs
