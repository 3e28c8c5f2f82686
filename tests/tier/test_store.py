"""The host tier's store: reservations, duplicates, LRU eviction, leases and loads, with
``check_integrity`` after every operation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvservice.tier import HostTier, LayoutKey

KEY = LayoutKey("mha", 2, 4, 2, 2, 8, 8, "float16", 1, 0, "nhd")
OTHER = LayoutKey("mha", 2, 4, 2, 2, 8, 8, "bfloat16", 1, 0, "nhd")
PAGE = 64


def h(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def tier(pages: int = 4, layouts: int = 1) -> HostTier:
    t = HostTier(pages * PAGE * layouts, layouts, clock_ms=lambda: 1_000)
    t.check_integrity()
    return t


def store(t: HostTier, hashes: np.ndarray, key: LayoutKey = KEY) -> int:
    res = t.reserve(key, PAGE, hashes)
    t.check_integrity()
    n = t.commit(res)
    t.check_integrity()
    return n


def test_commit_makes_reserved_pages_matchable() -> None:
    """Reserved pages are not matched until committed, then match as a leading prefix."""
    t = tier()
    res = t.reserve(KEY, PAGE, h(10, 11, 12))
    t.check_integrity()
    assert res.slots.size == 3 and t.match(KEY, h(10, 11, 12)) == 0
    t.commit(res)
    t.check_integrity()
    assert t.match(KEY, h(10, 11, 12, 13)) == 3 and t.match(KEY, h(11)) == 1 and t.match(KEY, h(9, 10)) == 0


def test_held_and_filling_hashes_are_not_reserved_again() -> None:
    """A held hash, one being filled, or one repeated in the request is a duplicate, not a copy."""
    t = tier(8)
    store(t, h(1, 2))
    filling = t.reserve(KEY, PAGE, h(3))
    res = t.reserve(KEY, PAGE, h(1, 3, 4, 4, 2, 5))
    t.check_integrity()
    assert res.hashes.tolist() == [4, 5] and res.positions.tolist() == [2, 5] and res.duplicates == 4
    t.commit(res)
    t.commit(filling)
    t.check_integrity()
    assert t.stats().held_pages == 5 and t.stats().duplicate_pages == 4


def test_abort_frees_the_reserved_slots() -> None:
    """An aborted reservation leaves nothing held and every slot free."""
    t = tier()
    res = t.reserve(KEY, PAGE, h(1, 2))
    t.abort(res)
    t.check_integrity()
    assert t.stats().held_pages == 0 and t.reserve(KEY, PAGE, h(1, 2, 3, 4)).slots.size == 4


def test_commit_keeps_only_the_pages_flagged_alive() -> None:
    """Pages whose copy is not trusted (the engine evicted them meanwhile) go back to free."""
    t = tier()
    res = t.reserve(KEY, PAGE, h(1, 2, 3))
    assert t.commit(res, np.array([True, False, True])) == 2
    t.check_integrity()
    assert t.held(KEY, h(1, 2, 3)).tolist() == [True, False, True]


def test_lru_page_is_evicted_first() -> None:
    """When full, the least recently used unpinned page makes room; a match is a use."""
    t = tier(3)
    store(t, h(1, 2, 3))
    t.match(KEY, h(1))
    store(t, h(4))
    assert t.held(KEY, h(1, 2, 3, 4)).tolist() == [True, False, True, True]
    assert t.stats().evictions == 1


def test_leased_pages_are_not_evicted() -> None:
    """Pages a lease pins survive a full tier; the request is cut short instead (no_room)."""
    t = tier(2)
    store(t, h(1, 2))
    assert t.lease("L", "s", 5_000, KEY, h(1, 2, 9)) == 2
    t.check_integrity()
    res = t.reserve(KEY, PAGE, h(3))
    t.check_integrity()
    assert res.slots.size == 0 and res.no_room == 1 and t.held(KEY, h(1, 2)).all()


def test_release_and_expiry_unpin_a_lease() -> None:
    """A released lease and an expired one no longer protect their pages."""
    t = tier(2)
    store(t, h(1, 2))
    t.lease("A", "s", 5_000, KEY, h(1))
    t.lease("B", "s", 500, KEY, h(1, 2))
    with pytest.raises(PermissionDenied):
        t.release_lease("A", "other")
    assert not t.release_lease("Z", "s") and t.release_lease("A", "s")
    t.check_integrity()
    assert t.expire_leases(now_ms=600) == 1
    t.check_integrity()
    assert t.leases() == 0 and t.reserve(KEY, PAGE, h(3, 4)).evicted == 2


def test_release_owner_drops_every_lease_of_a_session() -> None:
    """A session's end releases all of its tier leases and no other's."""
    t = tier(4)
    store(t, h(1, 2))
    t.lease("A", "s", 5_000, KEY, h(1))
    t.lease("B", "s", 5_000, KEY, h(1, 2))
    t.lease("C", "u", 5_000, KEY, h(2))
    assert t.release_owner("s") == 2
    t.check_integrity()
    assert t.leases() == 1


def test_load_pins_until_it_ends_and_refuses_missing_pages() -> None:
    """A load pins its slots against eviction; a missing hash is refused naming it, pinning nothing."""
    t = tier(2)
    store(t, h(1, 2))
    with pytest.raises(FailedPrecondition, match=r"hashes\[1\]"):
        t.begin_load(KEY, h(1, 7))
    t.check_integrity()
    load = t.begin_load(KEY, h(2, 1))
    t.check_integrity()
    assert t.reserve(KEY, PAGE, h(3)).no_room == 1
    t.end_load(load)
    t.check_integrity()
    assert t.reserve(KEY, PAGE, h(3)).evicted == 1


def test_layouts_get_arenas_of_their_own() -> None:
    """The same hash in two layouts is two pages; a layout past host_tier_layouts stores nothing."""
    t = tier(2, layouts=2)
    store(t, h(1))
    store(t, h(1), OTHER)
    assert t.stats().held_pages == 2 and t.stats().layouts == 2
    third = LayoutKey("mla", 2, 4, 1, 1, 8, 0, "float16", 1, 0, "nhd")
    assert t.reserve(third, PAGE, h(1)).no_room == 1
    t.check_integrity()


def test_a_layout_keeps_its_page_size() -> None:
    """Storing into a layout with another page size is refused naming page_bytes."""
    t = tier()
    store(t, h(1))
    with pytest.raises(InvalidArgument, match="page_bytes"):
        t.reserve(KEY, PAGE * 2, h(2))
    t.check_integrity()


def test_disabled_tier_stores_nothing() -> None:
    """host_tier_gb 0: nothing is reserved and nothing matches."""
    t = HostTier(0)
    assert not t.enabled and t.reserve(KEY, PAGE, h(1)).no_room == 1 and t.match(KEY, h(1)) == 0
    t.check_integrity()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.lists(st.integers(0, 12), min_size=1, max_size=6)), max_size=40)
)
def test_fuzz_operations_keep_integrity(ops: list[tuple[int, list[int]]]) -> None:
    """Random reserve/commit/abort/lease/release/load sequences keep every invariant."""
    t = tier(5)
    pending, loads = [], []
    for i, (op, xs) in enumerate(ops):
        hs = np.array(xs, dtype=np.uint64)
        if op == 0:
            pending.append(t.reserve(KEY, PAGE, hs))
        elif op == 1 and pending:
            t.commit(pending.pop(0))
        elif op == 2 and pending:
            t.abort(pending.pop())
        elif op == 3:
            t.lease(f"L{i % 3}", "s", 5_000, KEY, hs) if i % 2 else t.release_lease(f"L{i % 3}", "s")
        elif op == 4:
            held = hs[t.held(KEY, hs)]
            if held.size and np.unique(held).size == held.size:
                loads.append(t.begin_load(KEY, held))
            elif loads:
                t.end_load(loads.pop())
        t.check_integrity()
    for res in pending:
        t.abort(res)
    for load in loads:
        t.end_load(load)
    t.release_owner("s")
    t.check_integrity()
    assert int(sum(a.slots.pins.sum() for a in t._arenas.values())) == 0
