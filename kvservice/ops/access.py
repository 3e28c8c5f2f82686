"""Who sees the whole node in GetStats: admin callers, with or without a session.

A caller is an admin when any of these holds (checked in this order, first match names why)::

    session opened by an admin uid ........... "session"       (Session.admin, see Node.open_session)
    kvservice-credential on this very call ... "uid <n>"       (uid in admin_uids, root, the service's)
    client certificate name .................. "certificate"   (in admin_identities; mutual TLS)
    bearer token ............................. "token"         (in admin_token_file)

Everyone else sees what their session owns (nothing without a session), and the response says
so (``scope_note``). A credential is single-use, like on OpenSession: a GetStats that presents
one redeems it. NOTE: the listener's Guard has already admitted the call; this only widens what
an admitted caller sees, it never lets anyone in.
"""

from __future__ import annotations

import dataclasses

from kvservice_client.contract import TokenFile

from ..config import Config
from ..identity import CredentialBook
from ..sessions import Session

__all__ = ["AdminPolicy", "Viewer"]


@dataclasses.dataclass(frozen=True)
class Viewer:
    """One GetStats caller: ``admin`` sees everything; others see ``session_id``'s own."""

    admin: bool
    session_id: str = ""  # the caller's open session, "" without one
    why: str = ""  # what made it an admin ("session", "uid 0", "certificate", "token")

    def sees(self, owner_session_id: str) -> bool:
        return self.admin or (bool(self.session_id) and owner_session_id == self.session_id)

    def scope_note(self, total: int, shown: int) -> str:
        """'' for an admin; otherwise what the lists hold and how to see the whole node."""
        if self.admin:
            return ""
        mine = f"this session's own ({shown} of {total})" if self.session_id else f"none of {total}"
        return (
            f"buffer sets and sessions are scoped: {mine}. Admins see all without a session: a uid "
            "in admin_uids presenting a kvservice-credential (from <socket>.cred), a client "
            "certificate in admin_identities, or a token in admin_token_file"
        )


class AdminPolicy:
    """The configured admins (``admin_uids``, ``admin_identities``, ``admin_token_file``)."""

    def __init__(self, config: Config, credentials: CredentialBook) -> None:
        self._uids = config.security.admin_uid_set
        self._names = config.security.admin_identity_set
        self._tokens = (
            TokenFile(config.security.admin_token_file) if config.security.admin_token_file else None
        )
        self._credentials = credentials

    def viewer(
        self,
        session: Session | None,
        *,
        credential: str = "",
        certificate: str = "",
        bearer: str = "",
    ) -> Viewer:
        """Who is calling: ``session`` (None: no open session), a ``kvservice-credential`` it
        presented, its verified certificate name, its bearer token (as sent, 'Bearer …')."""
        sid = session.session_id if session is not None else ""
        if session is not None and session.admin:
            return Viewer(True, sid, "session")
        if credential:
            who = self._credentials.take(credential)
            if who is not None and who.uid in self._uids:
                return Viewer(True, sid, f"uid {who.uid}")
        if certificate and certificate in self._names:
            return Viewer(True, sid, "certificate")
        scheme, _, token = bearer.partition(" ")
        if self._tokens is not None and scheme.lower() == "bearer" and self._tokens.matches(token.strip()):
            return Viewer(True, sid, "token")
        return Viewer(False, sid)
