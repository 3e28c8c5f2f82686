"""The demo (the first thing a newcomer runs) prints its table and verdict, and nothing else."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_demo_prints_only_what_it_shows() -> None:
    """Two turns: every page verified, exit 0, no warning, ERROR or traceback from either service."""
    run = subprocess.run(
        [sys.executable, "-m", "kvservice", "demo", "--turns", "2"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "every received page verified: yes" in run.stdout, out
    assert not re.search(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback", out), out
