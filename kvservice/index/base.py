"""The prefix index contract: values it returns and the interface the servicer calls.

Model. Per buffer set (one engine rank's KV pool) the index is a radix tree of *pages*: an entry
is keyed by its chained page hash (DESIGN.md "Page hash"; the client's ``hashing.page_hashes``),
records the page index holding it, its parent entry, an eviction priority and how many leases pin
it. Because hashes are chained a hash names its whole prefix, so the tree is a hash table of
entries plus parent/child links::

    query hashes   h0 ── h1 ── h2 ── h3 ── h4          (one per full page of the prompt)
    buffer set A   h0@7  h1@3  h2@9                     matched_pages = 3, page_indices [7, 3, 9]
    buffer set B   h0@1                                 matched_pages = 1

Invariants (``check_integrity`` verifies every one; tests call it after each operation):

* an entry's parent is present (or is the root), so presence along a query is prefix-closed;
* a page index is held by at most one entry, and every page index is in ``[0, num_pages)``;
* *presence-only* buffer sets (fed by KV events, which carry no page indices) hold no page index;
* pin counts equal the number of live leases naming the entry.

Mutation. ``publish``, ``evict*``, ``remove_buffer_set``, ``lease``/``release*``/``expire_leases``
mutate; ``match`` only refreshes recency (used to order evictable leaves). Every method
validates all of its input before changing anything: a call that raises changed nothing.

Errors (``kvservice.errors``): malformed input (wrong shapes or dtypes, page index out of range,
duplicate page indices, more page indices than hashes, unchained hashes) -> ``InvalidArgument``
naming the field; unknown buffer set or lease -> ``NotFound``; a lease used by another owner ->
``PermissionDenied``; a lease whose pages were evicted, or a publish that contradicts the index
-> ``FailedPrecondition``.

Eviction policy for leased pages: the engine owns its allocator, so eviction always succeeds
(refusing would not keep the bytes alive). The lease is *detached* from the evicted entries and
``check_lease`` then raises ``FailedPrecondition`` naming the evicted pages; release still works.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

__all__ = ["BufferSetSpec", "EvictableLeaf", "IndexStats", "Lease", "Match", "PrefixIndexBase"]


@dataclasses.dataclass(frozen=True)
class BufferSetSpec:
    """What the index knows about a buffer set."""

    buffer_set_id: str
    engine_id: str
    page_size: int
    num_pages: int
    tp_rank: int = 0
    dp_rank: int = 0
    presence_only: bool = False


@dataclasses.dataclass(frozen=True)
class Match:
    """Longest present prefix of a query in one buffer set.

    ``page_indices`` (int64, length ``matched_pages``) is empty with ``scores_only`` and for
    presence-only buffer sets. ``min_priority`` is 0 when nothing matched.
    """

    buffer_set_id: str
    engine_id: str
    tp_rank: int
    dp_rank: int
    matched_pages: int
    page_indices: np.ndarray
    min_priority: int


@dataclasses.dataclass(frozen=True)
class Lease:
    """A pin on the matched entries of one ``match`` (every match with matched_pages > 0)."""

    lease_id: str
    owner: str
    expires_unix_ms: int
    pinned_pages: int


@dataclasses.dataclass(frozen=True)
class EvictableLeaf:
    """A leaf entry no lease pins: evicting its page keeps the tree prefix-closed."""

    page_index: int
    priority: int
    page_hash: int


@dataclasses.dataclass(frozen=True)
class IndexStats:
    """Counters as GetStats.IndexStats reports them."""

    entries: int
    leases: int
    lookups: int
    hit_pages: int
    query_pages: int
    entries_by_priority: dict[int, int]
    buffer_sets: int
    bytes_used: int


class PrefixIndexBase(abc.ABC):
    """Interface of the node's prefix index; ``PrefixIndex`` is the implementation."""

    @abc.abstractmethod
    def add_buffer_set(
        self,
        buffer_set_id: str,
        *,
        engine_id: str,
        page_size: int,
        num_pages: int,
        tp_rank: int = 0,
        dp_rank: int = 0,
        presence_only: bool = False,
    ) -> BufferSetSpec:
        """Start an empty index for a buffer set. Raises AlreadyExists / InvalidArgument."""

    @abc.abstractmethod
    def remove_buffer_set(self, buffer_set_id: str) -> int:
        """Drop the buffer set and its entries (leases on them detach); returns entries dropped."""

    @abc.abstractmethod
    def publish(
        self,
        buffer_set_id: str,
        hashes: np.ndarray,
        page_indices: np.ndarray | None,
        priority: int = 0,
        *,
        parent_hash: int | None = None,
    ) -> int:
        """Record that ``page_indices[i]`` holds page ``hashes[i]``; returns pages newly inserted.

        ``hashes`` (uint64) are chained from the root, or from ``parent_hash`` when given (that
        entry must exist). ``page_indices`` may be shorter than ``hashes``: only that many leading
        pages are published; it must be None for presence-only buffer sets (every hash is then
        published). A hash already present is refreshed: its priority becomes the higher of the
        two (a shared prefix is as important as its most important user) and it keeps its page
        index. A page index that holds a different entry was reused without EvictPages: that
        entry and its descendants are evicted first (the publish is the engine's latest word).
        """

    @abc.abstractmethod
    def evict(self, buffer_set_id: str, page_indices: np.ndarray) -> int:
        """Drop the entries at these page indices and all their descendants; returns entries dropped.

        Page indices that hold no entry are ignored; out-of-range or duplicate ones raise.
        """

    @abc.abstractmethod
    def evict_hashes(self, buffer_set_id: str, hashes: np.ndarray) -> int:
        """Like ``evict`` but names entries by hash (KV events); unknown hashes are ignored."""

    @abc.abstractmethod
    def evict_all(self, buffer_set_id: str) -> int:
        """Drop every entry of the buffer set; returns entries dropped."""

    @abc.abstractmethod
    def match(
        self,
        hashes: np.ndarray,
        *,
        page_size: int,
        buffer_set_ids: list[str] | None = None,
        dp_rank: int | None = None,
        scores_only: bool = False,
    ) -> list[Match]:
        """Longest present prefix per candidate buffer set, most matched pages first.

        Candidates: buffer sets of ``page_size`` (0 = any, for opaque hashes), restricted to
        ``buffer_set_ids`` (unknown ids raise NotFound) and to ``dp_rank`` when given. A match
        refreshes the matched entries' recency (eviction order), except with ``scores_only``:
        a router's probe is not a use.
        """

    @abc.abstractmethod
    def lease(self, matches: list[Match], ttl_ms: int, owner: str, *, now_ms: int | None = None) -> Lease:
        """Pin every matched entry of ``matches`` until ``now + ttl_ms``; presence-only raise."""

    @abc.abstractmethod
    def lease_count(self, owner: str) -> int:
        """Live leases of ``owner`` (a session), for the per-session cap."""

    @abc.abstractmethod
    def check_lease(self, lease_id: str, owner: str) -> None:
        """Raise NotFound (unknown/expired), PermissionDenied, or FailedPrecondition (evicted)."""

    @abc.abstractmethod
    def release_lease(self, lease_id: str, owner: str) -> None:
        """Unpin a lease. Raises NotFound for an unknown lease, PermissionDenied for another owner."""

    @abc.abstractmethod
    def release_owner(self, owner: str) -> int:
        """Unpin every lease of ``owner`` (its session ended); returns leases released."""

    @abc.abstractmethod
    def expire_leases(self, now_ms: int | None = None) -> int:
        """Unpin leases whose expiry is <= now; returns leases released."""

    @abc.abstractmethod
    def evictable_leaves(self, buffer_set_id: str, limit: int) -> list[EvictableLeaf]:
        """Unpinned leaves, lowest priority first, least recently used first within a priority."""

    @abc.abstractmethod
    def stats(self) -> IndexStats:
        """Counters and entries per priority."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError when an invariant of the module docstring does not hold."""
