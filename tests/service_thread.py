"""An in-process kvservice on its own event loop thread, and the test configuration."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
import threading
from typing import Any

from kvservice.config import Config
from kvservice.server import App, build_server

__all__ = ["ServerThread", "make_config"]


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
        try:  # its worker threads too: a test run starts hundreds of services
            self.call(self.loop.shutdown_default_executor(), timeout=10)
        except Exception:
            pass
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
        uds_path=os.path.join(d, "kv.sock"),
        tcp_address="127.0.0.1:0",
        insecure=True,
        log_format="text",
        transfer_integrity=True,  # on in tests (issue 33), off by default
    )
    return dataclasses.replace(base, **overrides).validate()
