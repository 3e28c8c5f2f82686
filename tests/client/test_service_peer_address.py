"""The service tells each session the address other kvservices reach it at
(SessionEvent.peer_address); the SDK exposes it as ``service_peer_address``, so an engine can name its own
service as the sender of its transfers without being configured with it."""

from __future__ import annotations

import asyncio
from typing import Any

from kvservice_client import AsyncClient, Client


async def _async_peer_address(address: str) -> str:
    async with AsyncClient(address) as kv:
        return await kv.service_peer_address()


def test_the_sdk_sees_the_services_peer_address(make_server: Any) -> None:
    """advertise_address, or a peer listener bound to a named host, is announced; a Unix socket
    alone or a wildcard bind announces nothing (a remote decode would otherwise name a sender that
    refuses the real one). Both clients see it, from the first event of the session stream."""
    unix = make_server(tcp_address="")
    advertised = make_server(tcp_address="", advertise_address="10.1.2.3:50052")
    named = make_server(tcp_address="", peer_tcp_address="127.0.0.1:0", insecure=True)
    wildcard = make_server(tcp_address="", peer_tcp_address="0.0.0.0:0", insecure=True)
    cases = (
        (unix, ""),
        (advertised, "10.1.2.3:50052"),
        (named, f"127.0.0.1:{named.app.peer_port}"),
        (wildcard, ""),
    )
    for server, want in cases:
        assert server.app.announced_address == want
        with Client(server.address) as kv:
            assert kv.service_peer_address == want
            assert kv.session_id  # the same session: asking opened it, nothing else
        assert asyncio.run(_async_peer_address(server.address)) == want


def test_an_older_service_that_sends_none_gives_an_empty_address(make_server: Any) -> None:
    """A service that does not fill the field (an older service): "" rather than a guess."""
    server = make_server(tcp_address="")
    assert server.app.servicer is not None
    server.app.servicer.peer_address = ""  # what an older service sends: no field
    with Client(server.address) as kv:
        assert kv.service_peer_address == ""
    assert asyncio.run(_async_peer_address(server.address)) == ""
