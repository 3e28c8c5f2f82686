"""Who may do what over the engine's Unix socket (docs/design/security.md).

The socket's file mode decides who reaches the socket at all. This gate decides, per call,
what a caller there may do. The kernel's identity comes from SO_PEERCRED, through a
single-use ``kvservice-credential`` (server/credentials.py) or through a session opened with
one::

    call over the socket             allowed_uids unset    allowed_uids set        KVPeer
    ───────────────────────────────────────────────────────────────────────────────────────────
    health                           yes                   yes                     yes
    OpenSession                      node.open_session checks the credential against allowed_uids
    with a session                   yes                   its uid is allowed      no (an engine)
    with a credential                yes                   its uid is allowed      own uid / peer_uids
    anonymous                        yes                   no                      no

KVPeer is for a co-located kvservice that proves it is one: a credential of this service's own
uid or of a configured ``peer_uids`` entry, and no session. An engine (a caller with a session)
never gets KVPeer here. The kernel cannot tell an engine that runs as the service's own uid
from the service; docs/security.md says so and recommends separate uids.
"""

from __future__ import annotations

import dataclasses
import os

import grpc

from ..identity import CredentialBook
from ..sessions import SESSION_METADATA_KEY, SessionRegistry
from .credentials import CREDENTIAL_METADATA_KEY

__all__ = ["LocalGate"]

_HEALTH = "/grpc.health.v1.Health/"
_PEER = "/kvservice.v1.KVPeer/"
_OPEN_SESSION = "/kvservice.v1.KVService/OpenSession"
Refusal = tuple[grpc.StatusCode, str]


@dataclasses.dataclass(frozen=True)
class LocalGate:
    """The per-call rule of the Unix socket (see the module docstring)."""

    credentials: CredentialBook
    sessions: SessionRegistry
    allowed_uids: frozenset[int] | None  # Config.security.allowed_uid_set (None: any uid the mode lets in)
    peer_uids: frozenset[int] = frozenset({os.getuid()})  # Config.security.peer_uid_set

    def refusal(self, method: str, metadata: dict[str, str]) -> Refusal | None:
        """Why this call over the socket may not run, or None."""
        if method.startswith(_HEALTH) or method == _OPEN_SESSION:
            return None  # OpenSession redeems its own credential (Node.open_session)
        if method.startswith(_PEER):
            return self._peer(metadata)
        if self.allowed_uids is None:
            return None
        sid = metadata.get(SESSION_METADATA_KEY)
        if sid:
            session = self.sessions.find(sid)
            if session is None:
                return None  # the servicer says why the session is gone (UNAUTHENTICATED)
            uid = session.identity.uid if session.identity is not None else None
            if uid is None or uid not in self.allowed_uids:
                return (
                    grpc.StatusCode.PERMISSION_DENIED,
                    "allowed_uids: this session is not of an identified, allowed uid",
                )
            return None
        who = self.credentials.take(metadata.get(CREDENTIAL_METADATA_KEY, ""))
        if who is None:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"allowed_uids: calls over the Unix socket must be identified (a '{SESSION_METADATA_KEY}' "
                f"or a '{CREDENTIAL_METADATA_KEY}' from <socket>.cred; the SDK sends one)",
            )
        if who.uid not in self.allowed_uids:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"allowed_uids: uid {who.uid} may not use this service",
            )
        return None

    def _peer(self, metadata: dict[str, str]) -> Refusal | None:
        if metadata.get(SESSION_METADATA_KEY):
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                "KVPeer on the Unix socket is for co-located kvservices, not engines",
            )
        who = self.credentials.take(metadata.get(CREDENTIAL_METADATA_KEY, ""))
        if who is None:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"KVPeer on the Unix socket needs a '{CREDENTIAL_METADATA_KEY}' from <socket>.cred of "
                "this service's uid or of peer_uids (co-located kvservices only)",
            )
        if who.uid not in self.peer_uids:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer_uids: uid {who.uid} is not a kvservice this service trusts on its Unix socket",
            )
        return None
