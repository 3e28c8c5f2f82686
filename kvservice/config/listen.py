"""Where the service listens, how it keeps connections alive and how it stops."""

from __future__ import annotations

import dataclasses
import os

from kvservice_client.contract import DEFAULT_KEEPALIVE, KeepalivePolicy

from ._option import ConfigError, check_host_port, check_range, opt

__all__ = ["Listen"]


@dataclasses.dataclass(frozen=True)
class Listen:
    """Listeners and lifecycle."""

    uds_path: str = opt(
        f"/tmp/kvservice-{os.getuid()}.sock",
        "Unix domain socket the engine API listens on ('' disables it).",
    )
    uds_mode: str = opt("0600", "File mode of the Unix socket, octal.")
    tcp_address: str = opt("", "Optional TCP listen address, host:port (port 0 picks one).")
    peer_tcp_address: str = opt(
        "",
        "Own TCP listener for KVPeer (service to service), host:port. When set, KVPeer is served "
        "there (and on the UDS), never on tcp_address.",
    )
    advertise_address: str = opt(
        "", "Address peers use to reach this service (default: the TCP address, else the UDS)."
    )
    service_name: str = opt("", "Label of this service in logs and stats (default: hostname).")
    grace_period_s: float = opt(10.0, "On SIGTERM, seconds in-flight work may take to finish.")
    session_grace_s: float = opt(
        5.0,
        "Seconds a session outlives a broken session stream (the client resumes it meanwhile); "
        "then its buffer sets, leases and transfers are released. Also bounds how long a killed "
        "engine's resources stay.",
    )
    keepalive_time_ms: int = opt(10_000, "Server pings an idle client this often to find dead ones (ms).")
    keepalive_timeout_ms: int = opt(5_000, "A ping unanswered this long closes the connection (ms).")
    keepalive_min_ping_interval_ms: int = opt(
        5_000,
        "Clients may ping this often without data (ms); the SDK pings every 10 s. Pings closer "
        "together count as strikes and the connection is cut after two.",
    )
    max_message_mb: int = opt(64, "Largest gRPC message, MiB.")

    def validate(self) -> None:
        if not self.uds_path and not self.tcp_address:
            raise ConfigError("uds_path/tcp_address: at least one listen address is required")
        try:
            mode = int(self.uds_mode, 8)
        except ValueError:
            raise ConfigError(f"uds_mode: {self.uds_mode!r} is not an octal file mode") from None
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"uds_mode: {self.uds_mode!r} is outside 0000..0777")
        if self.tcp_address:
            check_host_port("tcp_address", self.tcp_address)
        if self.peer_tcp_address:
            check_host_port("peer_tcp_address", self.peer_tcp_address)
        if self.grace_period_s < 0:
            raise ConfigError("grace_period_s: must be >= 0")
        if self.session_grace_s < 0:
            raise ConfigError("session_grace_s: must be >= 0")
        for name in ("keepalive_time_ms", "keepalive_timeout_ms", "keepalive_min_ping_interval_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0")
        check_range("max_message_mb", self.max_message_mb, 1, 2047)

    @property
    def uds_mode_int(self) -> int:
        return int(self.uds_mode, 8)

    @property
    def keepalive(self) -> KeepalivePolicy:
        """The keepalive policy of every listener and peer client (kvservice_client.contract)."""
        return dataclasses.replace(
            DEFAULT_KEEPALIVE,
            server_time_ms=self.keepalive_time_ms,
            timeout_ms=self.keepalive_timeout_ms,
            min_recv_ping_interval_ms=self.keepalive_min_ping_interval_ms,
            time_ms=max(DEFAULT_KEEPALIVE.time_ms, 2 * self.keepalive_min_ping_interval_ms),
        )
