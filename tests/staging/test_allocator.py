"""The first-fit range allocator: placement, coalescing and conservation under fuzzing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.staging import RangeAllocator


def test_first_fit_reuses_the_lowest_hole() -> None:
    """A freed hole is reused by the next request that fits, sizes rounded to the alignment."""
    a = RangeAllocator(1024, alignment=64)
    x, y, _ = a.alloc(100), a.alloc(64), a.alloc(64)
    assert x == (0, 128) and y == (128, 64)
    a.free(0)
    assert a.alloc(1) == (0, 64)
    a.check_integrity()


def test_frees_coalesce_into_one_range() -> None:
    """Freeing every range in any order leaves one free range covering the whole capacity."""
    a = RangeAllocator(4096, alignment=256)
    offs = [a.alloc(256)[0] for _ in range(16)]  # type: ignore[index]
    assert a.alloc(1) is None
    for off in offs[1::2] + offs[0::2]:
        a.free(off)
        a.check_integrity()
    assert a.alloc(4096) == (0, 4096)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000), st.integers(0, 50)), max_size=80))
def test_fuzz_alloc_free_keeps_integrity(ops: list[tuple[bool, int, int]]) -> None:
    """Random alloc/free sequences keep free + used == capacity with no overlap after every op."""
    a = RangeAllocator(8192, alignment=128)
    live: list[int] = []
    for is_alloc, nbytes, pick in ops:
        if is_alloc or not live:
            got = a.alloc(nbytes)
            if got is not None:
                live.append(got[0])
        else:
            a.free(live.pop(pick % len(live)))
        a.check_integrity()
    assert a.used_bytes == sum(a.size_of(o) for o in live)
