"""The peer allowlist: where SendDelta may send an engine's KV.

Entries (``peer_allowlist``, comma-separated): CIDRs (``10.0.0.0/8``, ``127.0.0.1/32``), DNS
suffixes (``.svc.cluster.local``, matched on the host name, never resolved), exact host names,
and ``unix`` (peers on this host's Unix sockets). An address matches when its host does.
"""

from __future__ import annotations

import ipaddress

from .errors import PermissionDenied

__all__ = ["AllowEntry", "check_peer_address", "parse_allowlist", "peer_allowed"]

# ("net", network) | ("suffix", ".example") | ("host", "name") | ("unix", "")
AllowEntry = tuple[str, object]


def parse_allowlist(text: str) -> tuple[AllowEntry, ...]:
    """Entries of the option, parsed once (ValueError names the bad entry)."""
    out: list[AllowEntry] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if "/" in entry:
            out.append(("net", ipaddress.ip_network(entry, strict=False)))  # ValueError on garbage
        elif entry == "unix":
            out.append(("unix", ""))
        elif entry.startswith("."):
            out.append(("suffix", entry))
        else:
            out.append(("host", entry))
    return tuple(out)


def _host(address: str) -> str | None:
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return None
    addr = address.removeprefix("ipv4:").removeprefix("ipv6:").removeprefix("dns:///")
    host = addr.rpartition(":")[0] if addr.count(":") == 1 or addr.startswith("[") else addr
    return host.strip("[]")


def peer_allowed(address: str, allow: tuple[AllowEntry, ...]) -> bool:
    host = _host(address)
    if host is None:
        return any(kind == "unix" for kind, _ in allow)
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for kind, value in allow:
        if kind == "net" and ip is not None and ip in value:  # type: ignore[operator]
            return True
        if kind == "suffix" and ip is None and host.endswith(str(value)):
            return True
        if kind == "host" and host == value:
            return True
    return False


def check_peer_address(address: str, allow: tuple[AllowEntry, ...]) -> None:
    """SendDelta may aim only at allowlisted peers (``peer_allowlist``; empty: any)."""
    if allow and not peer_allowed(address, allow):
        raise PermissionDenied(f"peer_address: {address!r} is not in this service's peer_allowlist")
