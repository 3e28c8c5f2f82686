"""Engine pools of same-host peer services, mapped here for the fused same-host route.

A receiver on this host hands its KV regions (shm names, CUDA IPC handles) in the ReceivePlan;
the sender's service maps them once per (peer service, buffer set) and copies page to page into
them. Opening can fail (another IPC namespace, another uid's 0600 segment, no CUDA IPC between
the devices): the caller then falls back to the transport and says why. Mappings unused for
``idle_s`` are closed by ``expire`` (the reaper calls it), and all of them at ``close``. Buffer
set ids are never reused, so a mapping cannot outlive its meaning, only its use.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from ..buffers import MappedRegion
from ..buffers.memory import MemoryImporter
from ..errors import FailedPrecondition, KVServiceError
from ..kernels import KVRegions
from .values import Plan

__all__ = ["PeerPools"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Mapped:
    regions: KVRegions
    mapped: list[MappedRegion]
    used: float


class PeerPools:
    def __init__(self, idle_s: float = 60.0) -> None:
        self._importer = MemoryImporter()
        self._maps: dict[tuple[str, str], _Mapped] = {}
        self._lock = threading.Lock()
        self.idle_s = idle_s

    def open(self, peer_service_id: str, plan: Plan) -> KVRegions:
        """The receiver rank's pools as KVRegions; raises FailedPrecondition with the reason."""
        key = (peer_service_id, plan.dst_buffer_set_id)
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None:
                hit.used = time.monotonic()
                return hit.regions
        lay = plan.dst_layout
        n = lay.num_layers
        want = n + lay.num_v_regions
        if len(plan.kv_handles) != want:
            raise FailedPrecondition(f"kv_handles: {len(plan.kv_handles)} regions, layout needs {want}")
        mapped: list[MappedRegion] = []
        try:
            for i, region in enumerate(plan.kv_handles):
                mapped.append(self._importer.import_region(f"kv_handles[{i}]", region))
            regions = KVRegions.of_layout(lay, [m.tensor for m in mapped[:n]], [m.tensor for m in mapped[n:]])
        except KVServiceError as exc:
            self._release(mapped)
            raise FailedPrecondition(f"cannot open the receiver's pools: {exc.message}") from None
        except Exception as exc:
            self._release(mapped)
            raise FailedPrecondition(
                f"cannot open the receiver's pools: {type(exc).__name__}: {exc}"
            ) from None
        with self._lock:
            self._maps[key] = _Mapped(regions, mapped, time.monotonic())
        return regions

    def expire(self) -> int:
        """Close mappings unused for ``idle_s``; returns how many."""
        now = time.monotonic()
        with self._lock:
            gone = [k for k, m in self._maps.items() if now - m.used > self.idle_s]
            old = [self._maps.pop(k) for k in gone]
        for m in old:
            self._release(m.mapped)
        return len(old)

    def close(self) -> None:
        with self._lock:
            old = list(self._maps.values())
            self._maps.clear()
        for m in old:
            self._release(m.mapped)

    def __len__(self) -> int:
        return len(self._maps)

    def _release(self, mapped: list[MappedRegion]) -> None:
        for m in mapped:
            try:
                self._importer.release(m)
            except Exception:  # closing a mapping must not fail a transfer
                log.exception("closing a peer pool mapping failed")
