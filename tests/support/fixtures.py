"""Fixtures of the end-to-end transfer tests (loopback service pairs, shm pools, clients); a
directory's conftest imports the ones it uses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kvservice_client import Client, Layout, ShmKVPool

__all__ = ["make_client", "make_pool", "pair"]


@pytest.fixture(params=["two-services", "same-host", "same-service"])
def pair(request: Any, make_server: Any) -> tuple[Any, Any]:
    """The sender's and the receiver's service on the loopback transport:

    two-services   two services that do not map each other's pools (same_host_route=off): the
                   cross-node path ("prefill node", "decode node")
    same-host      two services on this host that do: the receiver hands its pools over and the
                   sender copies page to page into them (FUSED)
    same-service   one service serving both engines (FUSED, no peer call at all)
    """
    if request.param == "same-service":
        server = make_server(transport="loopback")
        return server, server
    route = "auto" if request.param == "same-host" else "off"
    return (
        make_server(transport="loopback", same_host_route=route),
        make_server(transport="loopback", same_host_route=route),
    )


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
