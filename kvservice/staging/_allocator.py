"""First-fit range allocator over ``[0, capacity)`` with aligned sizes and coalescing frees.

::

    0        a        b             c          capacity
    |  used  |  free  |    used     |   free   |
             ^ free list (sorted by offset, never two adjacent)

Invariant (``check_integrity``): free + used == capacity, no two ranges overlap, free ranges
are sorted and coalesced. Not thread-safe: the pool serialises calls on its event loop.
"""

from __future__ import annotations

import bisect

__all__ = ["RangeAllocator"]


class RangeAllocator:
    """Hands out ``[offset, offset + size)`` ranges; sizes round up to ``alignment``."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._free_offsets: list[int] = [0] if self.capacity else []
        self._free_sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._used: dict[int, int] = {}

    def round(self, nbytes: int) -> int:
        """The size a request of ``nbytes`` occupies."""
        return -(-max(nbytes, 1) // self.alignment) * self.alignment

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def num_used(self) -> int:
        return len(self._used)

    def size_of(self, offset: int) -> int:
        """Size of the used range at ``offset`` (0 if none starts there)."""
        return self._used.get(offset, 0)

    def alloc(self, nbytes: int) -> tuple[int, int] | None:
        """Return ``(offset, size)`` of the lowest free range that fits, or None."""
        size = self.round(nbytes)
        for i, off in enumerate(self._free_offsets):
            have = self._free_sizes[off]
            if have >= size:
                del self._free_sizes[off]
                if have > size:
                    self._free_offsets[i] = off + size
                    self._free_sizes[off + size] = have - size
                else:
                    del self._free_offsets[i]
                self._used[off] = size
                return off, size
        return None

    def free(self, offset: int) -> int:
        """Free the range at ``offset``; return its size. KeyError if not allocated."""
        size = self._used.pop(offset)
        i = bisect.bisect_left(self._free_offsets, offset)
        start, end = offset, offset + size
        if i < len(self._free_offsets) and self._free_offsets[i] == end:  # merge right
            end += self._free_sizes.pop(end)
            del self._free_offsets[i]
        if i > 0:
            left = self._free_offsets[i - 1]
            if left + self._free_sizes[left] == start:  # merge left
                self._free_sizes[left] += end - start
                return size
        self._free_offsets.insert(i, start)
        self._free_sizes[start] = end - start
        return size

    def check_integrity(self) -> None:
        """Raise AssertionError if conservation, ordering, coalescing or alignment is broken."""
        assert self._free_offsets == sorted(self._free_sizes), "free list out of sync"
        ranges = sorted(
            [(o, s, "free") for o, s in self._free_sizes.items()]
            + [(o, s, "used") for o, s in self._used.items()]
        )
        pos = 0
        prev_kind = ""
        for off, size, kind in ranges:
            assert off == pos, f"gap or overlap at {pos}: next range starts at {off}"
            assert size > 0 and off % self.alignment == 0 and size % self.alignment == 0, (
                f"bad range {off}+{size}"
            )
            assert not (kind == prev_kind == "free"), f"uncoalesced free ranges at {off}"
            pos, prev_kind = off + size, kind
        assert pos == self.capacity, f"ranges cover {pos} of {self.capacity} bytes"
        assert self.used_bytes + sum(self._free_sizes.values()) == self.capacity
