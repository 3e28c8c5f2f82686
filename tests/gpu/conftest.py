"""GPU tests run in-process services with the loopback transport unless they start their own
(``tests.support.gpu.kvservice_procs``; ``services``: two of them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gpu import kvservice_procs


@pytest.fixture
def services(tmp_path: Path) -> Iterator[list[str]]:
    """Two kvservice processes (a, b) on Unix sockets; their addresses."""
    procs, socks = kvservice_procs(tmp_path, ("a", "b"))
    yield socks
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(20)
