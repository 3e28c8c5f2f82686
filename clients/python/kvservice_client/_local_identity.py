"""A fresh local credential on every call of a channel (KVPeer between co-located services).

A service reached over its Unix socket identifies local callers by the kernel (SO_PEERCRED):
a caller connects to ``<socket>.cred``, reads one single-use credential and presents it as
``kvservice-credential`` metadata. Engines do that once, on OpenSession. KVPeer calls between
co-located kvservices carry no session, so this interceptor fetches one credential per call
(one local connect and a line; the channel's calls on an open stream need none)::

    ch = grpc.aio.insecure_channel("unix:/run/kv.sock", interceptors=aio_credential_interceptors(
        "/run/kv.sock.cred"))
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

__all__ = [
    "CREDENTIAL_METADATA_KEY",
    "aio_credential_interceptors",
    "credential_path_of",
    "fetch_credential_async",
]

CREDENTIAL_METADATA_KEY = "kvservice-credential"


def credential_path_of(target: str) -> str:
    """``<socket>.cred`` for a "unix:" target, else ''."""
    if not target.startswith("unix:"):
        return ""
    return target.removeprefix("unix:").removeprefix("//") + ".cred"


async def fetch_credential_async(path: str, timeout: float = 5.0) -> str:
    """One single-use credential from ``path`` ('' when none can be had). Asynchronous, so a
    service that calls its own socket does not block the loop that answers it."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
    except (OSError, asyncio.TimeoutError):
        return ""
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (OSError, asyncio.TimeoutError):
        line = b""
    finally:
        writer.close()
    return line.decode().strip()


def aio_credential_interceptors(path: str) -> list[Any]:
    """Client interceptors adding a fresh credential from ``path`` to every call."""

    async def details_with(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        cred = await fetch_credential_async(path)
        extra = ((CREDENTIAL_METADATA_KEY, cred),) if cred else ()
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*(tuple(details.metadata or ()) + extra)),
            details.credentials,
            details.wait_for_ready,
        )

    class UU(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(await details_with(details), request)

    class US(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(await details_with(details), request)

    class SU(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
            return await continuation(await details_with(details), request_iterator)

    class SS(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(
            self, continuation: Any, details: Any, request_iterator: Any
        ) -> Any:
            return await continuation(await details_with(details), request_iterator)

    return [UU(), US(), SU(), SS()]
