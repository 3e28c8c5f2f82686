"""Leases: pin, release, expire, owner cleanup and the detach-on-evict policy."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from kvservice.index import PrefixIndex
from tests.support.index import Clock, hashes_of


def leased(index: PrefixIndex, owner: str = "s1", ttl: int = 1000) -> str:
    index.publish("a", hashes_of(4), np.array([4, 5, 6, 7]))
    ms = index.match(hashes_of(4), page_size=4)
    lease = index.lease(ms, ttl, owner)
    assert lease.pinned_pages == 4
    index.check_integrity()
    return lease.lease_id


def test_lease_pins_and_release_unpins(index: PrefixIndex) -> None:
    """A lease pins its pages (not evictable leaves) until released."""
    lid = leased(index)
    assert index.evictable_leaves("a", 10) == [] and index.stats().leases == 1
    index.check_lease(lid, "s1")
    index.release_lease(lid, "s1")
    assert [x.page_index for x in index.evictable_leaves("a", 10)] == [7]
    with pytest.raises(NotFound):
        index.release_lease(lid, "s1")


def test_lease_of_another_owner_is_denied(index: PrefixIndex) -> None:
    """Only the owner may use or release a lease."""
    lid = leased(index)
    with pytest.raises(PermissionDenied):
        index.release_lease(lid, "s2")
    with pytest.raises(PermissionDenied):
        index.check_lease(lid, "s2")


def test_expiry_releases(index: PrefixIndex, clock: Clock) -> None:
    """Leases past their expiry are released by expire_leases and unknown to check_lease."""
    lid = leased(index, ttl=50)
    assert index.expire_leases() == 0
    clock.ms += 50
    with pytest.raises(NotFound, match="expired"):
        index.check_lease(lid, "s1")
    lid2 = leased(index, ttl=10)
    clock.ms += 10
    assert index.expire_leases() == 1 and index.stats().leases == 0
    with pytest.raises(NotFound):
        index.check_lease(lid2, "s1")


def test_release_owner_drops_all_its_leases(index: PrefixIndex) -> None:
    """When a session ends every lease it owns goes; others stay."""
    leased(index, "s1")
    leased(index, "s1")
    keep = leased(index, "s2")
    assert index.release_owner("s1") == 2
    index.check_lease(keep, "s2")


def test_evicting_leased_page_detaches_and_lease_reports(index: PrefixIndex) -> None:
    """Eviction of a leased page succeeds; the lease then fails with FailedPrecondition naming it."""
    lid = leased(index)
    assert index.evict("a", np.array([6])) == 2
    index.check_integrity()
    with pytest.raises(FailedPrecondition, match=r"pages \[6, 7\]"):
        index.check_lease(lid, "s1")
    index.publish("a", hashes_of(4), np.array([4, 5, 6, 7]))  # reuse the freed slots
    with pytest.raises(FailedPrecondition):
        index.check_lease(lid, "s1")
    index.release_lease(lid, "s1")
    index.check_integrity()


def test_removed_buffer_set_breaks_lease(index: PrefixIndex) -> None:
    """A lease on a removed buffer set fails with FailedPrecondition and still releases."""
    lid = leased(index)
    index.remove_buffer_set("a")
    with pytest.raises(FailedPrecondition, match="removed"):
        index.check_lease(lid, "s1")
    index.release_lease(lid, "s1")


def test_bad_lease_requests(index: PrefixIndex) -> None:
    """ttl <= 0, no owner, and scores-only matches cannot make a lease."""
    index.publish("a", hashes_of(2), np.array([0, 1]))
    ms = index.match(hashes_of(2), page_size=4)
    with pytest.raises(InvalidArgument):
        index.lease(ms, 0, "s1")
    with pytest.raises(Unauthenticated):
        index.lease(ms, 10, "")
    with pytest.raises(InvalidArgument):
        index.lease(index.match(hashes_of(2), page_size=4, scores_only=True), 10, "s1")
    assert index.stats().leases == 0
