"""How ``kvservice status`` and ``kvservice top`` reach a service: flags -> an SDK ``Client``.

The client opens its session on the first GetStats (the SDK's calls are in the session from the
first call), so over the Unix socket it is identified by the kernel and an admin uid sees the
whole node; over TCP an admin certificate or token does the same.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvservice_client import Client

__all__ = ["add_connect_flags", "client_of", "default_address"]


def default_address() -> str:
    """``KVSERVICE_ADDRESS``, else the service's default socket (``KVSERVICE_UDS_PATH`` or
    /tmp/kvservice-<uid>.sock)."""
    from ..config import Listen

    uds = os.environ.get("KVSERVICE_UDS_PATH") or Listen().uds_path
    return os.environ.get("KVSERVICE_ADDRESS") or f"unix:{uds}"


def add_connect_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help='"unix:/path" or "host:port" (default: $KVSERVICE_ADDRESS or the default socket)',
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    p.add_argument("--tls-ca", default="", help="TCP: CA bundle to verify the service (TLS)")
    p.add_argument("--tls-cert", default="", help="TCP: client certificate (mutual TLS)")
    p.add_argument("--tls-key", default="", help="TCP: key of --tls-cert")
    p.add_argument("--token-file", default="", help="TCP: file whose first line is the bearer token")


def client_of(ns: argparse.Namespace, client_name: str) -> Client:
    """An SDK Client for the parsed connect flags (imported late: the CLI starts fast)."""
    from kvservice_client import ChannelSecurity, Client

    security = ChannelSecurity(
        ca_file=ns.tls_ca, cert_file=ns.tls_cert, key_file=ns.tls_key, token_file=ns.token_file
    )
    return Client(
        ns.address or default_address(), client_name=client_name, timeout=ns.timeout, security=security
    )
