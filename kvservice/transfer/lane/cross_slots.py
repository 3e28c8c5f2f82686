"""The cross-node lane's staging: an arena per device (host memory, each GPU), cut into slots
that receivers offer to senders (first fit, coalescing), and the size a delta is offered."""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...buffers.registry import BufferSet

__all__ = ["ALIGN", "Arena", "Slots", "geometry_signature", "slot_bytes", "unit_geometry_signature"]

ALIGN = 4096


def slot_bytes(pages: int, page_bytes: int, staging: int, streams: bool = True) -> int:
    """The slot a delta of ``pages`` is offered: the whole delta when it fits in half the
    staging (one WRITE), else (``streams``) half the staging, through which the sender streams
    it in chunks (two in flight); 0 (gRPC) when it may not stream or half the staging holds less
    than two pages."""
    nbytes = pages * page_bytes
    if nbytes <= staging // 2:
        return nbytes
    return staging // 2 if streams and staging // 2 >= 2 * page_bytes else 0


class Slots:
    """First-fit allocation of [0, size) in ``ALIGN`` steps; freed ranges coalesce."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []  # (offset, length), sorted

    def take(self, nbytes: int) -> int | None:
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (off, n) in enumerate(self._free):
            if n >= need:
                if n == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, n - need)
                return off
        return None

    def give(self, off: int, nbytes: int) -> None:
        n = -(-max(nbytes, 1) // ALIGN) * ALIGN
        i = bisect.bisect_left(self._free, (off, 0))
        self._free.insert(i, (off, n))
        if i + 1 < len(self._free) and off + n == self._free[i + 1][0]:  # merge the next
            self._free[i] = (off, n + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # and the previous
            prev = self._free[i - 1]
            self._free[i - 1] = (prev[0], prev[1] + self._free[i][1])
            del self._free[i]

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)


@dataclasses.dataclass
class Arena:
    device: int  # -1: host memory
    base: int
    slots: Slots


def geometry_signature(bs: BufferSet) -> int:
    """What a sender's pool and a receiver's pool must share for the lane's page-major packing:
    the layout (all but pool size and rank) and each region's page bytes."""
    import hashlib

    from .geometry import layout_signature

    lay = bs.layout
    per_page = [r.size // lay.num_pages for r in bs.regions]
    key = f"{layout_signature(lay)}/{per_page}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") or 1


def unit_geometry_signature(bs: BufferSet) -> int:
    """What a sender's pool and a receiver's pool of another page size must share for the lane
    to exchange units of gcd(page sizes) tokens across services (decision 0027): the layout but
    for its page size (``unit_signature``) and each region's bytes a token; 0 when the layout
    cannot (head-major pages, K and V apart within a page) or a region's page is not whole rows."""
    import hashlib

    from .geometry import unit_signature

    lay = bs.layout
    usig = unit_signature(lay)
    per_page = [r.size // lay.num_pages for r in bs.regions]
    if not usig or lay.page_size <= 0 or any(b % lay.page_size for b in per_page):
        return 0
    key = f"{usig}/{[b // lay.page_size for b in per_page]}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") or 1
