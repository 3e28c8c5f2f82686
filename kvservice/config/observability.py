"""What the service tells operators: logs and Prometheus metrics."""

from __future__ import annotations

import dataclasses

from ._option import ConfigError, check_choice, opt

__all__ = ["Observability"]


@dataclasses.dataclass(frozen=True)
class Observability:
    """Logs and metrics."""

    metrics_port: int = opt(0, "Prometheus metrics port (0: off; -1: pick a free one).")
    log_level: str = opt("INFO", "DEBUG, INFO, WARNING or ERROR.")
    log_format: str = opt("json", "'json' (one object per line) or 'text'.")

    def validate(self) -> None:
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port: must be -1, 0 or a port number")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: {self.log_level!r} is not DEBUG/INFO/WARNING/ERROR")
        check_choice("log_format", self.log_format, ("json", "text"))
