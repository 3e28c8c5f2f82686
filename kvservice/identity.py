"""Who a caller is: the kernel's word for local callers (see server/credentials.py).

``Identity`` travels with a session; ``CredentialBook`` holds the single-use credentials the
credential socket issued and OpenSession redeems.
"""

from __future__ import annotations

import dataclasses
import secrets
import socket
import struct
import threading
import time
from typing import Any

__all__ = [
    "CREDENTIAL_TTL_S",
    "LOCAL_PEER",
    "CredentialBook",
    "Identity",
    "certificate_identity",
    "peer_identity",
    "socket_identity",
]

CREDENTIAL_TTL_S = 30.0


@dataclasses.dataclass(frozen=True)
class Identity:
    """A local caller as the kernel identified it (SO_PEERCRED)."""

    uid: int
    gid: int
    pid: int


class CredentialBook:
    """Issued, not yet redeemed credentials (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._issued: dict[str, tuple[Identity, float]] = {}

    def issue(self, who: Identity) -> str:
        token = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            self._issued = {t: v for t, v in self._issued.items() if v[1] > now}
            self._issued[token] = (who, now + CREDENTIAL_TTL_S)
        return token

    def take(self, token: str) -> Identity | None:
        """The identity behind ``token`` (once), or None if unknown or expired."""
        with self._lock:
            entry = self._issued.pop(token, None)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]


LOCAL_PEER = "local"  # a service on this host's Unix socket, or this service itself


def certificate_identity(context: Any) -> str:
    """The verified client certificate's common name (else its first DNS name), or ''."""
    try:
        auth = context.auth_context()
    except Exception:
        return ""
    for key in ("x509_common_name", "peer_dns"):
        values = auth.get(key) or []
        if values:
            return bytes(values[0]).decode(errors="replace")
    return ""


def socket_identity(sock: socket.socket) -> Identity:
    """The kernel's (uid, gid, pid) of the process on the other end of a Unix socket."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return Identity(uid, gid, pid)


def peer_identity(context: Any) -> str:
    """Who a KVPeer call comes from, as far as it was proven: ``local`` over the Unix socket
    (gated by its file mode) or in-process, the certificate's name over mutual TLS, else ''
    (a peer token proves membership, not which service)."""
    if str(context.peer()).startswith("unix"):
        return LOCAL_PEER
    return certificate_identity(context)
