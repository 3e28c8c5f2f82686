"""PrefixIndex: publish, match, evict, priorities and errors (one property per test)."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvservice.index import PrefixIndex
from tests.support.index import hashes_of


def snapshot(ix: PrefixIndex) -> tuple:
    st = ix.stats()
    return (
        st.entries,
        tuple(sorted(st.entries_by_priority.items())),
        tuple(
            (m.buffer_set_id, m.matched_pages, tuple(m.page_indices.tolist()))
            for m in ix.match(hashes_of(8), page_size=4)
        ),
    )


def test_match_returns_longest_prefix_and_pages(index: PrefixIndex) -> None:
    """A published prefix matches up to the first page the query does not share."""
    h = hashes_of(6)
    assert index.publish("a", h, np.array([10, 11, 12, 13]), priority=3) == 4
    q = np.concatenate([h[:3], hashes_of(3, start=999)])
    (m,) = index.match(q, page_size=4, buffer_set_ids=["a"])
    assert (m.matched_pages, m.page_indices.tolist(), m.min_priority) == (3, [10, 11, 12], 3)
    index.check_integrity()


def test_matches_sorted_best_first_and_filtered(index: PrefixIndex) -> None:
    """Results list every candidate, most matched first; dp_rank and page_size filter them."""
    h = hashes_of(5)
    index.publish("a", h, np.arange(2))
    index.publish("b", h, np.arange(5))
    assert [(m.buffer_set_id, m.matched_pages) for m in index.match(h, page_size=4)] == [("b", 5), ("a", 2)]
    assert [m.buffer_set_id for m in index.match(h, page_size=4, dp_rank=0)] == ["a"]
    assert index.match(h, page_size=16) == []
    assert [m.buffer_set_id for m in index.match(h, page_size=0, buffer_set_ids=["a"])] == ["a"]


def test_scores_only_has_no_page_indices(index: PrefixIndex) -> None:
    """scores_only reports counts but no page indices."""
    index.publish("a", hashes_of(3), np.arange(3))
    (m,) = index.match(hashes_of(3), page_size=4, buffer_set_ids=["a"], scores_only=True)
    assert m.matched_pages == 3 and m.page_indices.size == 0


def test_publish_refresh_keeps_page_and_raises_priority(index: PrefixIndex) -> None:
    """Republishing present pages inserts nothing, keeps their page and takes the higher priority."""
    h = hashes_of(3)
    index.publish("a", h, np.array([1, 2, 3]), priority=-5)
    assert index.publish("a", h, np.array([1, 2, 3]), priority=7) == 0
    assert index.publish("a", h, np.array([1, 2, 3]), priority=0) == 0
    (m,) = index.match(h, page_size=4, buffer_set_ids=["a"])
    assert m.min_priority == 7 and index.stats().entries_by_priority == {7: 3}
    index.check_integrity()


def test_evict_drops_descendants(index: PrefixIndex) -> None:
    """Evicting a page drops its entry and every entry below it, siblings untouched."""
    h, g = hashes_of(4), hashes_of(4, start=1000)
    index.publish("a", h, np.array([0, 1, 2, 3]))
    index.publish("a", g, np.array([10, 11]))
    assert index.evict("a", np.array([1, 40])) == 3
    assert [m.matched_pages for m in index.match(h, page_size=4, buffer_set_ids=["a"])] == [1]
    assert index.indexed_pages("a") == 3
    index.check_integrity()


def test_publish_on_reused_page_evicts_old_entry(index: PrefixIndex) -> None:
    """Publishing a page index that holds another entry drops that entry's subtree first."""
    h, g = hashes_of(3), hashes_of(2, start=500)
    index.publish("a", h, np.array([5, 6, 7]))
    assert index.publish("a", g, np.array([6, 9])) == 2
    assert index.match(h, page_size=4, buffer_set_ids=["a"])[0].matched_pages == 1
    index.check_integrity()


def test_evict_all_and_remove_buffer_set(index: PrefixIndex) -> None:
    """evict_all empties a buffer set; remove_buffer_set reports and forgets its entries."""
    index.publish("a", hashes_of(4), np.arange(4))
    index.publish("a", hashes_of(2, start=77), np.arange(4, 6))
    assert index.evict_all("a") == 6 and index.indexed_pages("a") == 0
    index.publish("b", hashes_of(3), np.arange(3))
    assert index.remove_buffer_set("b") == 3
    with pytest.raises(NotFound):
        index.match(hashes_of(1), page_size=4, buffer_set_ids=["b"])


def test_evictable_leaves_lowest_priority_first(index: PrefixIndex) -> None:
    """Leaves come lowest priority first, least recently matched first within a priority."""
    index.publish("a", hashes_of(2, start=0), np.array([0, 1]), priority=5)
    index.publish("a", hashes_of(2, start=100), np.array([2, 3]), priority=-1)
    index.publish("a", hashes_of(2, start=200), np.array([4, 5]), priority=5)
    index.match(hashes_of(2, start=0), page_size=4)
    assert [(x.page_index, x.priority) for x in index.evictable_leaves("a", 10)] == [(3, -1), (5, 5), (1, 5)]
    assert len(index.evictable_leaves("a", 1)) == 1


@pytest.mark.parametrize(
    ("pages", "field"),
    [
        (np.array([0, 64]), "page_indices"),
        (np.array([-1]), "page_indices"),
        (np.array([3, 3]), "page_indices"),
        (np.arange(9), "page_indices"),
        (np.array([0.5]), "page_indices"),
    ],
)
def test_bad_publish_raises_and_changes_nothing(index: PrefixIndex, pages: np.ndarray, field: str) -> None:
    """Out-of-range, duplicate, too many or non-integer page indices raise InvalidArgument(field)."""
    index.publish("a", hashes_of(2), np.array([0, 1]))
    before = snapshot(index)
    with pytest.raises(InvalidArgument) as e:
        index.publish("a", hashes_of(8), pages)
    assert e.value.field == field and snapshot(index) == before
    index.check_integrity()


def test_unchained_hashes_rejected(index: PrefixIndex) -> None:
    """A present hash under a different parent (not a chain) raises and changes nothing."""
    h = hashes_of(3)
    index.publish("a", h, np.array([0, 1, 2]))
    before = snapshot(index)
    with pytest.raises(InvalidArgument, match="another prefix"):
        index.publish("a", np.array([123, h[2]], np.uint64), np.array([7, 8]))
    with pytest.raises(InvalidArgument, match="repeated"):
        index.publish("a", np.array([5, 5], np.uint64), np.array([7, 8]))
    assert snapshot(index) == before


def test_conflicting_page_for_present_hash_rejected(index: PrefixIndex) -> None:
    """A publish that puts an indexed hash on a page another of its hashes claims raises."""
    h = hashes_of(3)
    index.publish("a", h[:1], np.array([0]))
    before = snapshot(index)
    with pytest.raises(FailedPrecondition):
        index.publish("a", h, np.array([1, 0, 2]))
    assert snapshot(index) == before


def test_unknown_ids_and_duplicates(index: PrefixIndex) -> None:
    """Unknown buffer sets raise NotFound; a second add raises AlreadyExists; bad specs raise."""
    with pytest.raises(NotFound):
        index.publish("zz", hashes_of(1), np.array([0]))
    with pytest.raises(NotFound):
        index.evict("zz", np.array([0]))
    with pytest.raises(AlreadyExists):
        index.add_buffer_set("a", engine_id="e", page_size=4, num_pages=8)
    with pytest.raises(InvalidArgument):
        index.add_buffer_set("c", engine_id="e", page_size=0, num_pages=8)
    with pytest.raises(InvalidArgument):
        index.match(np.array([[1]], np.uint64), page_size=4)
    with pytest.raises(InvalidArgument):
        index.match(np.array([-1]), page_size=4)


def test_presence_only_buffer_set(index: PrefixIndex) -> None:
    """Presence-only sets index hashes without pages, continue chains from a parent and match."""
    index.add_buffer_set("ev", engine_id="vllm", page_size=4, num_pages=0, presence_only=True)
    h = hashes_of(5)
    assert index.publish("ev", h[:2], None) == 2
    assert index.publish("ev", h[2:], None, parent_hash=int(h[1])) == 3
    (m,) = index.match(h, page_size=4, buffer_set_ids=["ev"])
    assert m.matched_pages == 5 and m.page_indices.size == 0
    with pytest.raises(InvalidArgument):
        index.publish("ev", h, np.array([0]))
    with pytest.raises(FailedPrecondition):
        index.publish("ev", hashes_of(1, start=9), None, parent_hash=42)
    assert index.evict_hashes("ev", h[3:4]) == 2
    index.check_integrity()


def test_table_grows_past_initial_capacity() -> None:
    """Thousands of entries (several growths of slots and hash table) stay consistent."""
    ix = PrefixIndex()
    ix.add_buffer_set("a", engine_id="e", page_size=4, num_pages=20_000)
    h = hashes_of(5000)
    assert ix.publish("a", h, np.arange(5000)[::-1].copy()) == 5000
    ix.check_integrity()
    assert ix.evict("a", np.array([2500])) == 2501  # page 2500 holds h[2499]: h[2499:] go
    ix.check_integrity()
    assert ix.match(h, page_size=4)[0].matched_pages == 2499
