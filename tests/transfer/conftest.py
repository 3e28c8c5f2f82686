"""Fixtures for the end-to-end transfer tests: loopback service pairs, shm pools, clients."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kvservice_client import Client, Layout, ShmKVPool


@pytest.fixture(params=["two-services", "same-service"])
def pair(request: Any, make_server: Any) -> tuple[Any, Any]:
    """The sender's and the receiver's service: two in-process services on the loopback transport
    ("prefill node", "decode node"), or one service serving both engines (same node: the fused
    route)."""
    if request.param == "same-service":
        server = make_server(transport="loopback")
        return server, server
    return make_server(transport="loopback"), make_server(transport="loopback")


@pytest.fixture
def make_pool() -> Iterator[Any]:
    """Factory ``make_pool(layout, aux=None)``: a zeroed shm pool, closed (unlinked) at teardown."""
    made: list[ShmKVPool] = []

    def factory(layout: Layout, aux: dict[str, tuple[int, int]] | None = None) -> ShmKVPool:
        made.append(ShmKVPool.create(layout, aux=aux))
        return made[-1]

    yield factory
    for p in made:
        p.close()


@pytest.fixture
def make_client() -> Iterator[Any]:
    """Factory ``make_client(server)``: an engine's client (own session), closed at teardown."""
    made: list[Client] = []

    def factory(server: Any, timeout: float = 10.0) -> Client:
        made.append(Client(server.address, client_name="e2e", timeout=timeout))
        return made[-1]

    yield factory
    for c in made:
        c.close()
