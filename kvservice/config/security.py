"""Who may call the service, and how listeners and peers authenticate (docs/design/security.md)."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import TYPE_CHECKING

from kvservice_client.contract import PEER_TOKEN_METADATA_KEY, ChannelSecurity

from ._option import ConfigError, opt, uid_list

if TYPE_CHECKING:
    from ..peers_allow import AllowEntry

__all__ = ["Security"]

_PAIRS = (("tls_cert", "tls_key", "tls_client_ca"), ("peer_tls_cert", "peer_tls_key", "peer_tls_ca"))
_PEM_FILES = ("tls_cert", "tls_key", "tls_client_ca", "peer_tls_cert", "peer_tls_key", "peer_tls_ca")
_TOKEN_FILES = ("token_file", "peer_token_file", "admin_token_file")


@dataclasses.dataclass(frozen=True)
class Security:
    """Who may call, TLS, tokens, peers."""

    admin_uids: str = opt(
        "",
        "Comma-separated uids (besides root and the service's own uid) whose local sessions are "
        "admin: GetStats lists every buffer set to them, to others only their own.",
    )
    admin_identities: str = opt(
        "",
        "Comma-separated client certificate names (common name, else first DNS name) that are admin "
        "over mutual TLS: GetStats shows them the whole node without a session.",
    )
    admin_token_file: str = opt(
        "",
        "File of bearer tokens, one per line, that are admin over TCP (GetStats shows the whole "
        "node without a session); with token_file set they must be accepted there too.",
    )
    allowed_uids: str = opt(
        "",
        "Comma-separated uids that may open sessions over the Unix socket (root and the service's "
        "own uid always may); such sessions must then be identified (the SDK does it). Empty: "
        "any uid the socket's file mode lets in.",
    )
    peer_uids: str = opt(
        "",
        "Comma-separated uids of co-located kvservices (besides this service's own uid) that may "
        "call KVPeer over the Unix socket; each proves its uid with a credential from "
        "<socket>.cred. Engines never may.",
    )
    peer_allowlist: str = opt(
        "",
        "Where SendDelta may send KV: comma-separated CIDRs, DNS suffixes ('.svc.cluster.local'), "
        "host names and 'unix'. Empty: anywhere (logged as a warning at start).",
    )
    insecure: bool = opt(
        False,
        "Allow TCP listeners that authenticate nobody (no client certificates, no token). Logged as "
        "insecure at every start; without it such a listener is refused at start-up.",
    )
    tls_cert: str = opt("", "PEM certificate of the engine TCP listener (TLS); with tls_key.")
    tls_key: str = opt("", "PEM private key of tls_cert.")
    tls_client_ca: str = opt(
        "",
        "PEM CA bundle; when set, TCP callers must present a client certificate it signed (mutual "
        "TLS). Certificate files are re-read when they change (cert-manager rotation).",
    )
    token_file: str = opt(
        "",
        "File of bearer tokens, one per line, TCP engine callers must send ('authorization: Bearer "
        "<token>'); re-read when it changes (Kubernetes projected tokens, rotation with overlap).",
    )
    peer_tls_cert: str = opt(
        "",
        "PEM certificate this service presents to peers, as server and as client (one cluster CA; "
        "its common name is the service's peer identity).",
    )
    peer_tls_key: str = opt("", "PEM private key of peer_tls_cert.")
    peer_tls_ca: str = opt(
        "", "PEM CA bundle of the cluster: peers must present a certificate it signed (mutual TLS)."
    )
    peer_token_file: str = opt(
        "",
        "File of shared peer tokens, one per line: KVPeer calls over TCP must carry one "
        "('kvservice-peer-token'); this service sends the first. Re-read when it changes.",
    )

    def validate(self, tcp_address: str, peer_tcp_address: str) -> None:
        """TLS files in pairs and readable, token files readable, uid lists and the allowlist
        parse; no TCP listener (the listen group's addresses) that authenticates nobody unless
        ``insecure``."""
        self.admin_uid_set  # noqa: B018  (validates)
        self.allowed_uid_set  # noqa: B018
        self.peer_uid_set  # noqa: B018
        try:
            self.peer_allowlist_entries  # noqa: B018
        except ValueError as exc:
            raise ConfigError(f"peer_allowlist: {exc}") from None
        for cert, key, ca in _PAIRS:
            if bool(getattr(self, cert)) != bool(getattr(self, key)):
                raise ConfigError(f"{cert}/{key}: give both or neither")
            if getattr(self, ca) and not getattr(self, cert):
                raise ConfigError(f"{ca}: needs {cert} and {key} (client certificates need TLS)")
        for name in _PEM_FILES:
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{name}: cannot read {path}")
        for name in _TOKEN_FILES:
            path = getattr(self, name)
            if path:
                from kvservice_client.contract import TokenFile, TokenFileError

                try:
                    TokenFile(path).tokens()
                except TokenFileError as exc:
                    raise ConfigError(f"{name}: {exc}") from None
        if self.insecure:
            return
        if tcp_address and not self.engine_tcp_authenticated:
            raise ConfigError(
                "tcp_address: a TCP listener must authenticate its callers: set tls_client_ca (mutual "
                "TLS, with tls_cert/tls_key) or token_file, or pass --insecure to run it open"
            )
        if peer_tcp_address and not self.peer_tcp_authenticated:
            raise ConfigError(
                "peer_tcp_address: peers must authenticate: set peer_tls_ca (mutual TLS, with "
                "peer_tls_cert/peer_tls_key) or peer_token_file, or pass --insecure to run it open"
            )

    @property
    def engine_tcp_authenticated(self) -> bool:
        """tcp_address requires client certificates or a bearer token."""
        return bool(self.tls_client_ca or self.token_file)

    @property
    def peer_tcp_authenticated(self) -> bool:
        """peer_tcp_address requires peer certificates or a peer token."""
        return bool(self.peer_tls_ca or self.peer_token_file)

    @property
    def peer_security(self) -> ChannelSecurity:
        """How this service's peer channels authenticate to other services."""
        return ChannelSecurity(
            ca_file=self.peer_tls_ca,
            cert_file=self.peer_tls_cert,
            key_file=self.peer_tls_key,
            token_file=self.peer_token_file,
            token_key=PEER_TOKEN_METADATA_KEY,
        )

    @functools.cached_property
    def admin_uid_set(self) -> frozenset[int]:
        return frozenset({0, os.getuid(), *uid_list("admin_uids", self.admin_uids)})

    @functools.cached_property
    def admin_identity_set(self) -> frozenset[str]:
        return frozenset(n.strip() for n in self.admin_identities.split(",") if n.strip())

    @functools.cached_property
    def allowed_uid_set(self) -> frozenset[int] | None:
        """Uids allowed on the Unix socket, or None (no allowlist)."""
        extra = uid_list("allowed_uids", self.allowed_uids)
        return frozenset({0, os.getuid(), *extra}) if extra else None

    @functools.cached_property
    def peer_uid_set(self) -> frozenset[int]:
        """Uids whose processes may call KVPeer over the Unix socket (this service's own, always)."""
        return frozenset({os.getuid(), *uid_list("peer_uids", self.peer_uids)})

    @functools.cached_property
    def peer_allowlist_entries(self) -> tuple[AllowEntry, ...]:
        """Parsed once per Config (SendDelta checks every call against it)."""
        from ..peers_allow import parse_allowlist

        return parse_allowlist(self.peer_allowlist)
