"""TLS server credentials from PEM files, re-read when they change (cert-manager rotation)."""

from __future__ import annotations

import logging
import os

import grpc

__all__ = ["server_credentials"]

log = logging.getLogger(__name__)
_MAX_PEM = 1 << 20  # bytes read of a PEM file, at most


def _stamp(paths: tuple[str, ...]) -> tuple[tuple[int, int, int], ...]:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _config(cert: str, key: str, ca: str) -> grpc.ServerCertificateConfiguration:
    def read(p: str) -> bytes:
        with open(p, "rb") as f:
            data = f.read(_MAX_PEM + 1)
        if len(data) > _MAX_PEM:  # a certificate chain or key is kilobytes: this is not one
            raise OSError(f"{p} is larger than {_MAX_PEM} bytes")
        return data

    return grpc.ssl_server_certificate_configuration(
        [(read(key), read(cert))], root_certificates=read(ca) if ca else None
    )


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials:
    """TLS with ``cert``/``key``; client certificates signed by ``client_ca`` required when it is
    given. Each new connection's handshake checks the files and picks up a rotated set."""
    paths = tuple(p for p in (cert, key, client_ca) if p)
    state = {"stamp": _stamp(paths)}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            stamp = _stamp(paths)
            if stamp == state["stamp"]:
                return None
            config = _config(cert, key, client_ca)
        except OSError as exc:  # mid-rotation: keep serving with the old set
            log.warning("TLS files unreadable; keeping the previous certificates: %s", exc)
            return None
        state["stamp"] = stamp
        log.info("TLS certificates reloaded", extra={"cert": cert})
        return config

    return grpc.dynamic_ssl_server_credentials(
        _config(cert, key, client_ca), fetch, require_client_authentication=bool(client_ca)
    )
