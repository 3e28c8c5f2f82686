"""Local caller identity: who is on the other end of the Unix socket, as the kernel says.

gRPC does not hand a servicer the socket's peer credentials, so the service runs a tiny second
Unix socket beside the engine socket (``<uds_path>.cred``, same file mode). A client connects,
the service reads ``SO_PEERCRED`` (uid, gid, pid — the kernel's word, not the client's claim),
answers one line with a fresh random credential and closes. The client presents it once, as
``kvservice-credential`` metadata on OpenSession; the session then carries that identity::

    client ──connect──▶ <uds>.cred ── SO_PEERCRED → (pid, uid, gid) ── "c0ffee…\\n" ──▶ client
    client ──OpenSession(metadata kvservice-credential=c0ffee…)──▶ session.identity = uid …

Credentials are single-use and expire after 30 s (kvservice.identity); whoever can open the credential socket
could open the engine socket too, so this adds identity, not reach.
"""

from __future__ import annotations

import asyncio
import os
import socket

from kvservice_client.contract import CREDENTIAL_METADATA_KEY

from ..identity import CredentialBook, socket_identity

__all__ = ["CREDENTIAL_METADATA_KEY", "bind_credentials", "serve_credentials"]


def bind_credentials(path: str, mode: int) -> socket.socket:
    """Bind and listen on ``path`` now (before the engine socket exists, so a client that sees
    the engine socket finds this one too; connections queue until :func:`serve_credentials`)."""
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, mode)
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def serve_credentials(sock: socket.socket, book: CredentialBook) -> asyncio.AbstractServer:
    """Answer every connection on ``sock`` with one credential line for its kernel identity."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(book.issue(socket_identity(writer.get_extra_info("socket"))).encode() + b"\n")
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    return await asyncio.start_unix_server(answer, sock=sock)
