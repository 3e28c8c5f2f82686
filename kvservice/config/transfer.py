"""How transfers move: deadlines, transport, staging, per-peer budgets, routes, landing."""

from __future__ import annotations

import dataclasses

from ._option import ConfigError, check_choice, check_range, opt

__all__ = ["Transfer"]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Transfers: deadlines, transport, staging, routes, landing."""

    default_deadline_ms: int = opt(30_000, "Transfer deadline when a call gives none.")
    max_deadline_ms: int = opt(600_000, "Largest deadline a call may ask for.")
    transfer_retain_s: float = opt(300.0, "Seconds a finished transfer's status stays pollable.")
    transport: str = opt("nixl", "Data transport: 'nixl' (UCX; DRAM and VRAM) or 'loopback' (one process).")
    nixl_progress_delay_us: int = opt(
        1000,
        "Sleep of NIXL's UCX progress thread between idle polls (us). 0 is nixl's own default: the "
        "thread never sleeps and takes a whole core even when no transfer runs.",
    )
    host_staging_mb: int = opt(256, "Host staging pool, MiB (pinned when CUDA exists).")
    vram_staging_mb: int = opt(
        2048, "VRAM staging pool per GPU, MiB (only with CUDA buffer sets); bigger = fewer, larger batches."
    )
    workers_per_peer: int = opt(
        64, "Chunks moved to one destination service at once, at most (see peer_inflight_mb)."
    )
    peer_inflight_mb: int = opt(
        1024,
        "Bytes (MiB) of chunks moving to one destination service at once: per-peer concurrency is "
        "this byte budget (granted in arrival order), so many small deltas move side by side while "
        "large ones take turns; a chunk larger than the budget moves alone.",
    )
    same_host_route: str = opt(
        "auto",
        "'auto': a receiver's service on this host (same kernel boot id, reached over a Unix socket "
        "or loopback) hands over its engine pools and transfers copy page to page into them (FUSED), "
        "falling back to the transport when they cannot be opened; 'off': always the transport.",
    )
    transfer_integrity: bool = opt(
        False,
        "End-to-end integrity of incoming transfers: senders checksum every packed batch (and the "
        "pages of direct and fused chunks; XXH3-64 on CPU, a GPU reduction on VRAM) and this "
        "service verifies before unpacking or counting them, failing the transfer on a mismatch. "
        "Costs one extra read of the bytes on each side.",
    )
    landing_pool_mb: int = opt(
        512,
        "Landing pool per memory location (host memory; each GPU with CUDA buffer sets), MiB: landing "
        "transfers (ExpectDelta.landing) land here until claimed. Allocated at its first landing; a "
        "declaration that does not fit is refused at once (RESOURCE_EXHAUSTED).",
    )
    landing_ttl_ms: int = opt(
        10_000, "How long landed pages wait for a Claim when the declaration gives no TTL."
    )
    landing_max_ttl_ms: int = opt(600_000, "Largest landing TTL a declaration may ask for.")
    landing_evict: str = opt(
        "never",
        "When a landing does not fit: 'never' (refuse it) or 'oldest' (end the oldest LANDED, unclaimed "
        "landings FAILED 'landing evicted' if that makes it fit, else refuse without evicting).",
    )

    def validate(self) -> None:
        if not 0 < self.default_deadline_ms <= self.max_deadline_ms:
            raise ConfigError("default_deadline_ms: must be > 0 and <= max_deadline_ms")
        if self.transfer_retain_s < 0:
            raise ConfigError("transfer_retain_s: must be >= 0")
        check_choice("transport", self.transport, ("nixl", "loopback"))
        check_range("nixl_progress_delay_us", self.nixl_progress_delay_us, 0, 1_000_000)
        if self.host_staging_mb < 1 or self.vram_staging_mb < 1:
            raise ConfigError("host_staging_mb/vram_staging_mb: must be >= 1")
        check_range("workers_per_peer", self.workers_per_peer, 1, 256)
        if self.peer_inflight_mb < 1:
            raise ConfigError("peer_inflight_mb: must be >= 1")
        check_choice("same_host_route", self.same_host_route, ("auto", "off"))
        check_range("landing_pool_mb", self.landing_pool_mb, 1, 1 << 20)
        if not 1 <= self.landing_ttl_ms <= self.landing_max_ttl_ms:
            raise ConfigError("landing_ttl_ms: must be in 1..landing_max_ttl_ms")
        check_choice("landing_evict", self.landing_evict, ("never", "oldest"))
