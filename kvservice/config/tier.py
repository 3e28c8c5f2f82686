"""The host tier: service-owned host memory (pinned with CUDA) keeping whole KV pages by hash."""

from __future__ import annotations

import dataclasses
import os

from ._option import ConfigError, check_range, opt

__all__ = ["AUTO_CAP_BYTES", "AUTO_FRACTION", "Tier"]

AUTO_FRACTION = 0.10  # of the RAM free at start
AUTO_CAP_BYTES = 64 << 30


def _free_ram_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


@dataclasses.dataclass(frozen=True)
class Tier:
    """Host tier: size, layouts, fill budget."""

    host_tier_gb: float = opt(
        -1.0,
        "Host memory of the KV tier, GiB (pinned when CUDA is present). -1: a tenth of the RAM free at "
        "start, at most 64 GiB; 0 turns the tier off.",
    )
    host_tier_layouts: int = opt(
        2,
        "How many layouts (model shapes) the tier keeps pages of: each gets an equal share of "
        "host_tier_gb when its first page is stored; a layout past this count is not kept.",
    )
    host_tier_fill_gbps: float = opt(
        2.0,
        "Write-behind budget, GB/s (10^9 bytes per second): how fast pages the engines publish "
        "are copied into the tier in the background (OffloadPages, which an engine waits on, "
        "is not limited).",
    )

    @property
    def host_tier_bytes(self) -> int:
        """The tier's size in bytes, ``-1`` resolved against the free RAM now."""
        if self.host_tier_gb < 0:
            return int(min(_free_ram_bytes() * AUTO_FRACTION, AUTO_CAP_BYTES))
        return int(self.host_tier_gb * (1 << 30))

    def validate(self) -> None:
        if self.host_tier_gb < 0 and self.host_tier_gb != -1:
            raise ConfigError("host_tier_gb: must be >= 0 GiB, or -1 for a tenth of the free RAM")
        check_range("host_tier_layouts", self.host_tier_layouts, 1, 64)
        if not self.host_tier_fill_gbps > 0:
            raise ConfigError("host_tier_fill_gbps: must be > 0 GB/s")
