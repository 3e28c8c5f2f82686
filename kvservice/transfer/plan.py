"""Chunk planning: which pages of a SendDelta chunk move, and where they land (numpy, no loops).

Positions are page numbers in the sequence. The receiver declared ``prefix_pages`` (pages it
already holds) and one destination page per position after them::

    position        0 … prefix-1 │ prefix   prefix+1   …   prefix+n-1
    receiver has    ██ skipped ██ │ dst[0]   dst[1]     …   dst[n-1]      (dst_page_indices)
    chunk k         offset … offset+len(src)-1          (src_page_indices, in order)
    moved           positions ≥ prefix:  src[i] ──▶ dst[offset + i - prefix]

Pages of the chunk below ``prefix`` are counted as skipped; a position past ``prefix+n-1`` is
an error (the sender holds more pages than the receiver made room for).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import FailedPrecondition, InvalidArgument

__all__ = ["ChunkMap", "map_chunk", "src_pages_array"]


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


def src_pages_array(values: object, num_pages: int, field: str = "src_page_indices") -> np.ndarray:
    """Validate engine-named source pages: in range and distinct (vectorised)."""
    arr = np.asarray(values, dtype=np.int64).reshape(-1)
    if arr.size:
        if arr.min() < 0 or arr.max() >= num_pages:
            bad = int(arr[(arr < 0) | (arr >= num_pages)][0])
            raise InvalidArgument(field, f"page index {bad} is outside the buffer set's 0..{num_pages - 1}")
        if np.unique(arr).size != arr.size:
            raise InvalidArgument(field, "page indices must be distinct")
    return arr


def map_chunk(chunk_offset: int, src: np.ndarray, prefix_pages: int, dst_pages: np.ndarray) -> ChunkMap:
    """Map a chunk onto the receiver's plan; raises FailedPrecondition if it overruns it."""
    positions = chunk_offset + np.arange(src.size, dtype=np.int64)
    keep = positions >= prefix_pages
    skipped = int(src.size - np.count_nonzero(keep))
    positions = positions[keep]
    if positions.size and positions[-1] >= prefix_pages + dst_pages.size:
        raise FailedPrecondition(
            f"src_page_indices: chunk reaches sequence page {int(positions[-1])} but the receiver declared "
            f"{prefix_pages} prefix + {dst_pages.size} destination pages"
        )
    return ChunkMap(src[keep], dst_pages[positions - prefix_pages], positions, skipped)
