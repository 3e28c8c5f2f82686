"""Where a built server listens, and the addresses that follow from it (known once bound)."""

from __future__ import annotations

import dataclasses

from ..config import Config

__all__ = ["Listeners"]

_WILDCARDS = ("0.0.0.0", "[::]", "")


@dataclasses.dataclass(frozen=True)
class Listeners:
    """The bound listeners: the engine socket (``uds_path``; "" for none), the engine TCP port and
    the peer TCP port (0: not listening)."""

    uds_path: str
    tcp_port: int
    peer_port: int

    @property
    def address(self) -> str:
        """Address engines should use (the UDS when there is one)."""
        return f"unix:{self.uds_path}" if self.uds_path else f"127.0.0.1:{self.tcp_port}"

    def peer_address(self, cfg: Config) -> str:
        """Address other kvservices reach this one at: ``advertise_address``, else the peer TCP
        listener (or the engine TCP port when it serves peers), else the engine address."""
        if cfg.listen.advertise_address:
            return cfg.listen.advertise_address
        if self.peer_port:
            host = cfg.listen.peer_tcp_address.rpartition(":")[0]
            return f"{'127.0.0.1' if host in _WILDCARDS else host}:{self.peer_port}"
        if self.tcp_port and cfg.peers_on_engine_tcp:
            host = cfg.listen.tcp_address.rpartition(":")[0]
            return f"{'127.0.0.1' if host in _WILDCARDS else host}:{self.tcp_port}"
        return self.address

    def announced_address(self, cfg: Config) -> str:
        """What sessions are told (SessionEvent.peer_address), for a decode to name this service as
        the sender of its transfers: only an address that means this service wherever the decode
        runs — ``advertise_address``, or a TCP listener for peers bound to a named host. '' when
        that is not known (a wildcard bind reports 127.0.0.1, a Unix socket only this host; a
        sending service needs no listener at all): the engine then names no sender, as before,
        rather than one that would refuse the real one."""
        if cfg.listen.advertise_address:
            return cfg.listen.advertise_address
        listeners = [(self.peer_port, cfg.listen.peer_tcp_address)]
        if cfg.peers_on_engine_tcp:
            listeners.append((self.tcp_port, cfg.listen.tcp_address))
        for port, bound in listeners:
            host = bound.rpartition(":")[0]
            if port and host not in _WILDCARDS:
                return f"{host}:{port}"
        return ""
