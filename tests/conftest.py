"""Shared fixtures: an in-process kvservice on a temporary UDS (and TCP port 0)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvservice.config import Config
from kvservice.server import App, build_server


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


class ServerThread:
    """Runs an App on its own event loop in a background thread."""

    def __init__(self, config: Config) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.app: App = self.call(self._build(config))

    async def _build(self, config: Config) -> App:
        app = build_server(config)
        await app.start()
        return app

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 0.5) -> None:
        self.call(self.app.stop(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    @property
    def address(self) -> str:
        return self.app.address

    @property
    def node(self) -> Any:
        return self.app.node


def make_config(**overrides: Any) -> Config:
    d = tempfile.mkdtemp(prefix="kvs-")
    base = Config(
        uds_path=os.path.join(d, "kv.sock"), tcp_address="127.0.0.1:0", insecure=True, log_format="text"
    )
    return dataclasses.replace(base, **overrides).validate()


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
