"""Shared fixtures: an in-process kvservice on a temporary UDS (and TCP port 0)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.services import ServerThread, make_config


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def server() -> Iterator[ServerThread]:
    s = ServerThread(make_config())
    yield s
    s.stop()


@pytest.fixture
def make_server() -> Iterator[Any]:
    """Factory: ``make_server(**config_overrides)`` starts a server, stopped at teardown."""
    started: list[ServerThread] = []

    def factory(**overrides: Any) -> ServerThread:
        s = ServerThread(make_config(**overrides))
        started.append(s)
        return s

    yield factory
    for s in started:
        s.stop()
