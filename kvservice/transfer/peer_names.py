"""The peer identity a sending service will prove, learned from its address (docs/design/security.md).

ExpectDelta may name the sending service's address. Then the receiving service fills an empty
``allowed_senders`` with the identity that service proves when it calls, before any plan
exists, so no other peer can fetch the plan first and bind itself as the sender::

    sender_address                   allowed_senders
    ──────────────────────────────────────────────────────────────────────────────────────
    this service, or "unix:..."      {"local"}
    host:port, peer mutual TLS       {its certificate's name (as a TLS server; the same
                                      certificate it presents as a client), "local"}
    host:port, peer token only       left empty: a token proves membership, not who; the
                                      plan's ticket binds whoever fetches first (docs/security.md)

"local" stays allowed because a co-located service may reach us over the Unix socket, where only
this service's uid or ``peer_uids`` get KVPeer (server/local_gate.py).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from typing import Any

from ..config import Config
from ..errors import Unavailable
from ..identity import LOCAL_PEER

__all__ = ["PeerNames"]

_TTL_S = 60.0


class PeerNames:
    """Identities of sending services by address, cached for a minute."""

    def __init__(self, config: Config, own_address: str) -> None:
        self._cfg = config
        self._own = own_address
        self._cache: dict[str, tuple[frozenset[str], float]] = {}

    async def allowed(self, address: str) -> frozenset[str]:
        """``allowed_senders`` for a transfer from the service at ``address`` (empty: unknown)."""
        if address == self._own or address.startswith("unix:"):
            return frozenset({LOCAL_PEER})
        cfg = self._cfg
        if not (cfg.security.peer_tls_ca and cfg.security.peer_tls_cert):
            return frozenset()
        hit = self._cache.get(address)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        try:
            name = await asyncio.to_thread(
                _certificate_name,
                address,
                cfg.security.peer_tls_ca,
                cfg.security.peer_tls_cert,
                cfg.security.peer_tls_key,
            )
        except (OSError, ValueError) as exc:
            raise Unavailable(
                f"sender_address: cannot learn the peer identity of {address!r}: {exc}"
            ) from None
        names = frozenset({name, LOCAL_PEER})
        self._cache[address] = (names, time.monotonic() + _TTL_S)
        return names


def _certificate_name(address: str, ca: str, cert: str, key: str, timeout: float = 5.0) -> str:
    """The common name (else the first DNS name) of the certificate the peer at ``address``
    presents, verified against the cluster CA (as kvservice.identity reads a client's)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False  # identity is the certificate's name, as for client certificates
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        peer: dict[str, Any] = dict(tls.getpeercert() or {})
    for rdn in peer.get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return str(v)
    for k, v in peer.get("subjectAltName", ()):
        if k == "DNS":
            return str(v)
    raise ValueError("its certificate names no identity")
