"""This host's identity, for the same-host route between two services on one kernel.

Two services with the same kernel boot id share a kernel, so one can open the other's engine
pools (POSIX shm names, CUDA IPC handles) if they also share the IPC namespace and the
permissions allow; opening decides, the boot id only says it is worth trying. A receiver hands
its pools only over a local connection (Unix socket or loopback), never to another host.
"""

from __future__ import annotations

import functools
import socket

__all__ = ["boot_id", "hostname", "is_local_peer"]


@functools.cache
def boot_id() -> str:
    """The kernel's boot id ("" where the kernel does not expose one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def hostname() -> str:
    return socket.gethostname()


def is_local_peer(peer: str) -> bool:
    """Whether a gRPC ``context.peer()`` string is a Unix socket or a loopback address."""
    if peer.startswith("unix:") or peer.startswith("unix-abstract:"):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
        return host in ("::1", "0:0:0:0:0:0:0:1") or host.startswith("::ffff:127.")
    return False
