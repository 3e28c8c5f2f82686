"""The native data plane: the lane (same node and cross-node), its modules and caches."""

from __future__ import annotations

import dataclasses

from ._option import check_range, opt

__all__ = ["DataPlane"]


@dataclasses.dataclass(frozen=True)
class DataPlane:
    """Native lane (same node and cross-node), prebuilt modules, JIT caches."""

    lane: bool = opt(
        True,
        "The native lane (<uds_path>.lane): engines on this node send same-node transfers through a "
        "C++ thread that copies and answers without the service's Python (docs/decisions/0014); "
        "off: gRPC only. Needs a C++ compiler the first time (built once, cached) unless native_dir "
        "holds a prebuilt module (the image's does).",
    )
    lane_cross_mb: int = opt(
        256,
        "MiB of staging per device (host memory, and each GPU) for the cross-node lane: a delta "
        "offered at ExpectDelta to another service's engine goes from that service's lane straight "
        "into this one's (one NIXL WRITE, notified; no Python on its path; docs/decisions/0018). "
        "Half receives, half packs what this lane sends; a delta above a quarter streams "
        "through a slot in chunks (lane_cross_stream). 0: off. Needs the lane and the NIXL "
        "transport.",
    )
    native_dir: str = opt(
        "",
        "Directory of prebuilt native lane modules (<native_dir>/<tag>/, made by "
        "`KVSERVICE_NATIVE_DIR=... python -m kvservice.transfer.lane.native`; the image has one): a module "
        "built for this source, Python and torch is imported from there, read-only, and no compiler "
        "is needed. Default: built on first use into the cache dir.",
    )
    cache_dir: str = opt(
        "",
        "Writable directory for JIT caches (numba, Triton); nothing is written into the installed "
        "package. Default: $XDG_CACHE_HOME/kvservice, else <tmp>/kvservice-<uid>.",
    )

    def validate(self) -> None:
        check_range("lane_cross_mb", self.lane_cross_mb, 0, 1 << 20, "0..1048576 (MiB)")
