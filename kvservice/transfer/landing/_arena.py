"""One landing arena: a single allocation in one memory location, carved into landings.

::

    arena: landing_pool_mb of host memory (pinned when CUDA exists) or of VRAM on cuda:N,
    allocated when its first landing arrives, then kept
    ┌──────────────────────┬────────┬──────────────────────┬──────┐
    │ landing 1            │  free  │ landing 2            │ free │   RangeAllocator: first fit,
    │ K0 K1 .. V0 V1 ..    │        │ K0 K1 .. V0 V1 ..    │      │   coalescing frees
    └──────────────────────┴────────┴──────────────────────┴──────┘
    one landing = its regions back to back, each rounded up to ``ALIGN`` bytes

Not thread-safe: the landing pool calls it from the event loop only.
"""

from __future__ import annotations

import copy

import torch

from ...errors import ResourceExhausted
from ...staging import RangeAllocator

__all__ = ["ALIGN", "Arena"]

ALIGN = 256


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Arena:
    """``capacity`` bytes on ``device`` ("cpu" or "cuda:N") with a range allocator."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        try:
            if device.type == "cuda":
                buf = torch.empty(capacity, dtype=torch.uint8, device=device)
                self.kind = f"vram:{device.index}"
            else:
                buf = torch.empty(capacity, dtype=torch.uint8)
                self.kind = "host"
                if torch.cuda.is_available():
                    buf, self.kind = buf.pin_memory(), "pinned"
        except (RuntimeError, MemoryError) as exc:  # torch's OutOfMemoryError is a RuntimeError
            raise ResourceExhausted(
                f"landing_pool_mb: cannot allocate {capacity} bytes on {device}: {exc}"
            ) from None
        self.buffer = buf
        self.device = device
        self._alloc = RangeAllocator(capacity, ALIGN)
        self.peak_bytes = 0

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    @staticmethod
    def footprint(sizes: list[int]) -> int:
        """Bytes a landing of regions ``sizes`` occupies."""
        return sum(_aligned(s) for s in sizes)

    def take(self, sizes: list[int]) -> tuple[int, list[torch.Tensor]] | None:
        """One range holding regions of ``sizes`` bytes: (its offset, a uint8 view per region);
        None when no free range is big enough."""
        got = self._alloc.alloc(self.footprint(sizes))
        if got is None:
            return None
        off, views = got[0], []
        pos = off
        for s in sizes:
            views.append(self.buffer[pos : pos + s])
            pos += _aligned(s)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return off, views

    def give(self, offset: int) -> int:
        """Free the landing at ``offset``; its size."""
        return self._alloc.free(offset)

    def trial(self) -> RangeAllocator:
        """A copy of the allocator to try frees and allocations on (eviction plans)."""
        return copy.deepcopy(self._alloc)

    def check_integrity(self) -> None:
        self._alloc.check_integrity()
