"""The peer allowlist: where SendDelta may send an engine's KV.

Entries (``peer_allowlist``, comma-separated): CIDRs (``10.0.0.0/8``, ``127.0.0.1/32``), DNS
suffixes (``.svc.cluster.local``, matched on the host name, never resolved), exact host names,
and ``unix`` (peers on this host's Unix sockets). An address matches when its host does.
"""

from __future__ import annotations

import ipaddress

__all__ = ["parse_allowlist", "peer_allowed"]


def parse_allowlist(text: str) -> tuple[str, ...]:
    """Entries of the option, validated (ValueError names the bad entry)."""
    out = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if "/" in entry:
            ipaddress.ip_network(entry, strict=False)  # raises ValueError on garbage
        out.append(entry)
    return tuple(out)


def _host(address: str) -> str | None:
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return None
    addr = address.removeprefix("ipv4:").removeprefix("ipv6:").removeprefix("dns:///")
    host = addr.rpartition(":")[0] if addr.count(":") == 1 or addr.startswith("[") else addr
    return host.strip("[]")


def peer_allowed(address: str, allow: tuple[str, ...]) -> bool:
    host = _host(address)
    if host is None:
        return "unix" in allow
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for entry in allow:
        if "/" in entry:
            if ip is not None and ip in ipaddress.ip_network(entry, strict=False):
                return True
        elif entry.startswith("."):
            if ip is None and host.endswith(entry):
                return True
        elif host == entry:
            return True
    return False
