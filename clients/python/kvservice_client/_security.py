"""How a channel authenticates: TLS (optionally with a client certificate) and/or a token.

One ``ChannelSecurity`` builds the sync and the asyncio channel of the SDK clients, and the
service's own peer channels. The token goes as metadata on every call (re-read from its file
when that changes), added by a client interceptor so it works on TLS and on Unix-socket
channels alike::

    sec = ChannelSecurity(ca_file="ca.pem", cert_file="engine.pem", key_file="engine.key")
    kv = Client("kvservice.node:50051", security=sec)            # mutual TLS
    kv = Client("10.0.0.5:50051", security=ChannelSecurity(token_file="/var/run/kv/token"))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import grpc

from ._tokens import TokenFile

__all__ = ["BEARER_METADATA_KEY", "PEER_TOKEN_METADATA_KEY", "PLAIN", "ChannelSecurity"]

BEARER_METADATA_KEY = "authorization"  # "Bearer <token>" (engine callers)
PEER_TOKEN_METADATA_KEY = "kvservice-peer-token"  # service-to-service calls


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


@dataclasses.dataclass(frozen=True)
class ChannelSecurity:
    """TLS files (PEM) and a token file; all empty means a plain channel."""

    ca_file: str = ""  # verify the server against this CA (TLS when set)
    cert_file: str = ""  # client certificate (mutual TLS)
    key_file: str = ""
    token_file: str = ""  # token sent on every call
    token_key: str = BEARER_METADATA_KEY  # PEER_TOKEN_METADATA_KEY between services
    server_name: str = ""  # expected name in the server certificate (default: the target host)
    credential_path: str = ""  # a "unix:" target's <socket>.cred: a fresh local credential per call

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def _metadata(self) -> list[tuple[str, str]]:
        if not self.token_file:
            return []
        token = _token_files.setdefault(self.token_file, TokenFile(self.token_file)).first()
        value = f"Bearer {token}" if self.token_key == BEARER_METADATA_KEY else token
        return [(self.token_key, value)]

    def _options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        out = list(options)
        if self.tls and self.server_name:
            out.append(("grpc.ssl_target_name_override", self.server_name))
        return out

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(_read(self.ca_file), _read(self.key_file), _read(self.cert_file))

    def channel(self, target: str, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
        """A blocking channel to ``target``."""
        if self.tls and not target.startswith("unix"):
            ch = grpc.secure_channel(target, self._credentials(), options=self._options(options))
        else:
            ch = grpc.insecure_channel(target, options=list(options))
        if self.token_file:
            ch = grpc.intercept_channel(ch, _SyncToken(self))
        return ch

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        """An asyncio channel to ``target``."""
        interceptors = _aio_token_interceptors(self) if self.token_file else []
        if self.credential_path and target.startswith("unix"):
            from ._local_identity import aio_credential_interceptors

            interceptors += aio_credential_interceptors(self.credential_path)
        if self.tls and not target.startswith("unix"):
            return grpc.aio.secure_channel(
                target, self._credentials(), options=self._options(options), interceptors=interceptors or None
            )
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors or None)


PLAIN = ChannelSecurity()  # no TLS, no token (Unix sockets; --insecure services)
_token_files: dict[str, TokenFile] = {}


class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, sec: ChannelSecurity) -> None:
        self._sec = sec

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_Details(details, list(details.metadata or ()) + self._sec._metadata()), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(
            _Details(details, list(details.metadata or ()) + self._sec._metadata()), request_iterator
        )

    intercept_stream_stream = intercept_stream_unary


def _aio_token_interceptors(sec: ChannelSecurity) -> list[Any]:
    def details_with_token(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*(tuple(details.metadata or ()) + tuple(sec._metadata()))),
            details.credentials,
            details.wait_for_ready,
        )

    class UU(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(details_with_token(details), request)

    class US(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(details_with_token(details), request)

    class SU(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
            return await continuation(details_with_token(details), request_iterator)

    class SS(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(
            self, continuation: Any, details: Any, request_iterator: Any
        ) -> Any:
            return await continuation(details_with_token(details), request_iterator)

    return [UU(), US(), SU(), SS()]
