"""Two network namespaces joined by a veth pair, for runs that must cross a real network stack
(UCX over TCP) between two services on one machine; needs root and iproute2.

    with veth_pair() as net:             # net.names = ("kvs-a-…", "kvs-b-…")
        ...                              # net.ips   = ("10.77.0.1", "10.77.0.2")

``python_in(name, dir)`` is an executable that runs this Python inside a namespace (for
``multiprocessing``'s spawn): like ``ip netns exec`` it gives the process the namespace's view of
``/sys/class/net`` too, which UCX reads to find its interfaces (``setns`` alone leaves the host's).
Only these two addresses are ever used; the link carries nothing but this machine's own test
traffic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator

__all__ = ["UCX_TCP_ENV", "NetPair", "python_in", "veth_pair"]

# UCX on TCP only (plus self): what two hosts without RDMA use, and no shared-memory shortcut
UCX_TCP_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "all"}


@dataclasses.dataclass(frozen=True)
class NetPair:
    names: tuple[str, str]
    ips: tuple[str, str]
    devices: tuple[str, str]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@contextlib.contextmanager
def veth_pair(ips: tuple[str, str] = ("10.77.0.1", "10.77.0.2")) -> Iterator[NetPair]:
    """Create the namespaces and the link (raises OSError / CalledProcessError when it cannot);
    delete them on exit."""
    tag = uuid.uuid4().hex[:6]
    net = NetPair((f"kvs-a-{tag}", f"kvs-b-{tag}"), ips, (f"va{tag}", f"vb{tag}"))
    try:
        for ns in net.names:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", net.devices[0], "type", "veth", "peer", "name", net.devices[1])
        for ns, dev, ip in zip(net.names, net.devices, net.ips, strict=True):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield net
    finally:
        for ns in net.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def python_in(name: str, directory: str) -> str:
    """Path of a script that runs ``sys.executable`` with its arguments in namespace ``name``."""
    path = os.path.join(directory, f"python-{name}")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec ip netns exec {shlex.quote(name)} {shlex.quote(sys.executable)} "$@"\n')
    os.chmod(path, 0o755)
    return path
