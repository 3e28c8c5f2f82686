"""Chunk planning: which pages of a SendDelta chunk move, and where they land (numpy, no loops).

Positions are page numbers in the sequence. The receiver declared ``prefix_pages`` (pages it
already holds) and one destination page per position after them::

    position        0 … prefix-1 │ prefix   prefix+1   …   prefix+n-1
    receiver has    ██ skipped ██ │ dst[0]   dst[1]     …   dst[n-1]      (dst_page_indices)
    chunk k         offset … offset+len(src)-1          (src_page_indices, in order)
    moved           positions ≥ prefix:  src[i] ──▶ dst[offset + i - prefix]

Pages of the chunk below ``prefix`` are counted as skipped; a position past ``prefix+n-1`` is
an error (the sender holds more pages than the receiver made room for).

Pools of different page sizes (an SGLang page of 1 or 64 tokens, a vLLM block of 16) exchange
*units* of ``g = gcd`` tokens instead (``Units``): page ``p`` of a side is its units
``p*m + [0, m)``, positions count units, and both sides' page lists are expanded the same way,
so the table above holds unit for unit. The sequence ends inside a page, so the side with the
larger last page may hold units the other has no room or no tokens for: units past the
receiver's room are dropped when they lie in the sender's final page (its padding), and the
receiver accepts a tail of its last page that no sender wrote (``Units.unsent_ok``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from kvservice_client import Layout

from ..errors import FailedPrecondition, InvalidArgument
from ..kernels import distinct

__all__ = ["ChunkMap", "Units", "map_chunk", "src_pages_array"]


@dataclasses.dataclass(frozen=True)
class Units:
    """What moves between one sender pool and one receiver pool: units of ``tokens`` tokens."""

    tokens: int
    src_per_page: int
    dst_per_page: int

    @classmethod
    def of(cls, src: Layout, dst: Layout) -> Units:
        g = math.gcd(src.page_size, dst.page_size)
        return cls(g, src.page_size // g, dst.page_size // g)

    @staticmethod
    def expand(pages: np.ndarray, per_page: int) -> np.ndarray:
        """Page indices -> the indices of their units, in order (no copy for whole pages)."""
        if per_page == 1:
            return pages
        return (pages[:, None] * per_page + np.arange(per_page, dtype=np.int64)[None, :]).reshape(-1)

    def land(self, positions: np.ndarray, prefix_pages: int, dst_pages: np.ndarray) -> np.ndarray:
        """Receiver units of unit ``positions``; InvalidArgument unless each lies in the declared
        delta (past the prefix, within the destination pages)."""
        rel = positions - prefix_pages * self.dst_per_page
        if rel.size and (rel.min() < 0 or rel.max() >= dst_pages.size * self.dst_per_page):
            raise InvalidArgument(
                "positions", f"outside the declared delta 0..{dst_pages.size * self.dst_per_page - 1}"
            )
        if self.dst_per_page == 1:
            return dst_pages[rel]
        return dst_pages[rel // self.dst_per_page] * self.dst_per_page + rel % self.dst_per_page

    def unsent_ok(self, covered: np.ndarray) -> bool:
        """A finished sender left only a tail of the receiver's last page unwritten (past the
        sequence's last token), if anything."""
        missing = np.flatnonzero(~covered)
        return not missing.size or (
            covered.size - missing[0] < self.dst_per_page and missing.size == covered.size - missing[0]
        )


_WHOLE = Units(1, 1, 1)


@dataclasses.dataclass(frozen=True)
class ChunkMap:
    """Pages of one chunk that move: ``src[i]`` goes to ``dst[i]`` at ``positions[i]``."""

    src: np.ndarray
    dst: np.ndarray
    positions: np.ndarray
    skipped: int

    @property
    def num_pages(self) -> int:
        return int(self.src.size)


_SMALL = 64  # below this many indices Python's min/max/set beat numpy's per-call costs


def src_pages_array(values: Any, num_pages: int, field: str = "src_page_indices") -> np.ndarray:
    """Validate engine-named source pages: in range and distinct (vectorised; a one-page call
    costs a few µs: it is on every transfer's path, twice)."""
    small = not isinstance(values, np.ndarray) and hasattr(values, "__len__") and len(values) <= _SMALL
    arr = np.array(list(values), dtype=np.int64) if small else np.asarray(values, dtype=np.int64).reshape(-1)
    if not arr.size:
        return arr
    if arr.size <= _SMALL:
        seq = arr.tolist()
        lo, hi, unique = min(seq), max(seq), len(set(seq)) == len(seq)
    else:
        lo, hi, unique = int(arr.min()), int(arr.max()), True
    if lo < 0 or hi >= num_pages:
        bad = int(arr[(arr < 0) | (arr >= num_pages)][0])
        raise InvalidArgument(field, f"page index {bad} is outside the buffer set's 0..{num_pages - 1}")
    if not unique or (arr.size > _SMALL and not distinct(arr, num_pages)):
        raise InvalidArgument(field, "page indices must be distinct")
    return arr


def map_chunk(
    chunk_offset: int,
    src: np.ndarray,
    prefix_pages: int,
    dst_pages: np.ndarray,
    units: Units | None = None,
    last: bool = False,
) -> ChunkMap:
    """Map a chunk onto the receiver's plan; raises FailedPrecondition if it overruns it.
    With ``units`` the map is in units (see the module doc); ``last`` marks the sender's last chunk."""
    u = units or _WHOLE
    ms, md = u.src_per_page, u.dst_per_page
    n = int(src.size)
    if ms == md == 1 and prefix_pages <= chunk_offset and chunk_offset + n <= prefix_pages + dst_pages.size:
        # whole pages wholly inside the declared delta (every same-page-size chunk that fits):
        # the general path below gives the same map, at ~10 numpy calls more per chunk
        start = chunk_offset - prefix_pages
        return ChunkMap(src, dst_pages[start : start + n], np.arange(chunk_offset, chunk_offset + n), 0)
    src_units = Units.expand(src, ms)
    positions = chunk_offset * ms + np.arange(src_units.size, dtype=np.int64)
    prefix, room = prefix_pages * md, prefix_pages * md + dst_pages.size * md
    keep = positions >= prefix
    skipped = int(src.size - np.count_nonzero(keep[ms - 1 :: ms]))  # pages wholly in the prefix
    over = positions >= room
    if over.any():
        first_over = int(positions[over][0])
        padding = last and ms > 1 and first_over >= positions[-1] + 1 - ms and first_over % ms
        if not padding:
            raise FailedPrecondition(
                f"src_page_indices: chunk reaches sequence page {first_over // ms} but the receiver declared "
                f"{prefix_pages} prefix + {dst_pages.size} destination pages"
                + (f" (of {u.tokens * md} tokens; ours hold {u.tokens * ms})" if units and ms != md else "")
            )
        keep &= ~over
    positions = positions[keep]
    return ChunkMap(src_units[keep], u.land(positions, prefix_pages, dst_pages), positions, skipped)
