"""The host tier contract: values it returns and the interface the node calls.

Model. The tier is service-owned host memory (pinned when CUDA is present, plain pages in CPU
mode) that keeps *whole pages* -- every layer's K and V of one page, nothing else -- keyed by the
index's chained page hash, so a prefix outlives the engine pool that computed it. Pages of
different layouts never mix: one *arena* per ``LayoutKey`` (what makes two pools' pages byte
compatible), each a ``[capacity, page_bytes]`` array of *slots*::

    arena (one layout)   slot 0   slot 1   slot 2   slot 3  ...
    state                HELD     FREE     FILLING  HELD
    hash                 h0       -        h7       h3         (the table maps h0 -> 0, h3 -> 3)
    pins                 1        0        0        0          (leases + loads in progress)

    a page inside a slot: [K layer 0 | K layer 1 | ... | V layer 0 | ... ]   (wire order)

Slot states: FREE (on the free stack), FILLING (reserved by a fill or an offload whose copy is in
progress: not in the table, not evictable, nobody reads it), HELD (in the table: matchable,
loadable, evictable when unpinned).

Invariants (``check_integrity`` verifies every one; tests call it after each operation):

* free + filling + held == capacity, per arena; the free stack holds exactly the FREE slots;
* the hash table holds exactly the HELD slots, each under its own hash, and no hash twice;
* a slot's pins equal the live leases naming it plus the loads copying out of it; only HELD
  slots are pinned.

Mutation. ``reserve`` takes FREE slots for the hashes not yet held (a held or filling hash is a
duplicate and is skipped), evicting HELD unpinned slots least recently used first when no FREE
slot is left; ``commit``/``abort`` end a reservation (HELD / FREE again). ``begin_load`` pins
HELD slots for a copy out and ``end_load`` unpins them. ``lease``/``release*``/``expire_leases``
pin and unpin. ``match`` refreshes recency. Every method validates its input before changing
anything: a call that raises changed nothing.

NOTE: a hash being filled counts as held for a later reserve (it is not copied twice); should
that fill be dropped (its engine evicted the page mid-copy), the page is lost to the tier, never
stored wrong: an OffloadPages that met it as ``already_held`` may have let its engine overwrite
its own copy. Rare (an evict racing two copies of one hash), and it costs a recompute only.

Errors (``kvservice.errors``): malformed hashes -> ``InvalidArgument`` naming the field; a load
of a hash the tier does not hold -> ``FailedPrecondition`` naming it; releasing another
session's lease -> ``PermissionDenied``; an unknown lease on release -> False (the index may
know it: the caller decides whether that is NotFound).

Thread safety: every method takes the tier's lock; copies run outside it on reserved or pinned
slots, which nobody else touches.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Protocol

import numpy as np
from kvservice_client import Layout

__all__ = ["HostTierBase", "LayoutKey", "Load", "Reservation", "TierListener", "TierStats"]


@dataclasses.dataclass(frozen=True)
class LayoutKey:
    """What makes two buffer sets' pages byte compatible (every Layout field but the pool's size
    and DP rank). NOTE: there is no model name in a Layout: pools of two models with the same
    shapes share a key, and their hashes are told apart by the hash seed or the engine's own
    opaque hashes, as in the prefix index."""

    kind: str
    num_layers: int
    page_size: int
    total_kv_heads: int
    local_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    dtype: str
    tp_size: int
    tp_rank: int
    page_layout: str

    @classmethod
    def of(cls, layout: Layout) -> LayoutKey:
        return cls(
            layout.kind,
            layout.num_layers,
            layout.page_size,
            layout.total_kv_heads,
            layout.local_kv_heads,
            layout.head_dim_k,
            layout.head_dim_v,
            layout.dtype,
            layout.tp_size,
            layout.tp_rank,
            str(layout.page_layout),
        )

    def describe(self) -> str:
        return (
            f"{self.kind} {self.page_layout} {self.num_layers}L x{self.page_size} "
            f"{self.local_kv_heads}/{self.total_kv_heads}h {self.head_dim_k}/{self.head_dim_v} {self.dtype} "
            f"tp{self.tp_rank}/{self.tp_size}"
        )


@dataclasses.dataclass(frozen=True)
class Reservation:
    """FILLING slots reserved for ``hashes`` (one slot each, same order) in one arena.

    ``duplicates``: hashes of the request already held or filling (not reserved); ``no_room``:
    hashes left out because every slot was pinned or filling; ``evicted``: HELD slots evicted to
    make room. ``positions``: where each reserved hash was in the request (int64)."""

    key: LayoutKey
    hashes: np.ndarray  # uint64
    slots: np.ndarray  # int64
    positions: np.ndarray  # int64
    duplicates: int
    no_room: int
    evicted: int


@dataclasses.dataclass(frozen=True)
class Load:
    """HELD slots pinned for a copy out (``end_load`` unpins them)."""

    key: LayoutKey
    slots: np.ndarray  # int64, one per requested hash, same order


@dataclasses.dataclass(frozen=True)
class TierStats:
    """Counters as GetStats and the metrics report them."""

    capacity_bytes: int
    used_bytes: int
    held_pages: int
    layouts: int
    hits: int  # pages asked for by match or load that the tier held
    misses: int
    evictions: int
    stored_pages: int
    stored_bytes: int
    duplicate_pages: int  # pages a fill or an offload skipped because the tier held them
    loaded_pages: int
    fill_backlog_pages: int


class TierListener(Protocol):
    """Told of the pages the tier starts and stops holding (under the tier's lock: enqueue, return).
    The KV events re-publisher is one: the tier's pages go out with ``medium`` "CPU"."""

    def tier_stored(self, key: LayoutKey, hashes: np.ndarray) -> None: ...

    def tier_removed(self, key: LayoutKey, hashes: np.ndarray) -> None: ...


class HostTierBase(abc.ABC):
    """Interface of the node's host tier; ``HostTier`` is the implementation."""

    @property
    @abc.abstractmethod
    def enabled(self) -> bool:
        """False when ``host_tier_gb`` is 0: every call then stores nothing and holds nothing."""

    @abc.abstractmethod
    def reserve(self, key: LayoutKey, page_bytes: int, hashes: np.ndarray) -> Reservation:
        """Reserve FILLING slots for the hashes not already held (the arena of ``key`` is made on
        first use, its pages ``page_bytes`` long; a later call with another size raises
        InvalidArgument). Evicts LRU unpinned HELD slots when no FREE one is left."""

    @abc.abstractmethod
    def slots_view(self, key: LayoutKey) -> np.ndarray:
        """The arena of ``key`` as ``[capacity, page_bytes]`` uint8 (copies write reserved slots
        and read pinned ones; nothing else may be touched)."""

    @abc.abstractmethod
    def commit(self, res: Reservation, keep: np.ndarray | None = None) -> int:
        """Make the reserved slots HELD (only where ``keep`` is True; the rest go FREE); returns
        pages committed."""

    @abc.abstractmethod
    def abort(self, res: Reservation) -> None:
        """Return every reserved slot to FREE (the copy failed)."""

    @abc.abstractmethod
    def match(self, key: LayoutKey, hashes: np.ndarray, *, touch: bool = True) -> int:
        """Leading pages of ``hashes`` the tier holds in ``key``'s arena (0 without one)."""

    @abc.abstractmethod
    def held(self, key: LayoutKey, hashes: np.ndarray) -> np.ndarray:
        """Whether each hash is HELD (bool array)."""

    @abc.abstractmethod
    def begin_load(self, key: LayoutKey, hashes: np.ndarray, field: str = "hashes") -> Load:
        """Pin the HELD slots of every hash; FailedPrecondition naming ``field[i]`` if one is not held."""

    @abc.abstractmethod
    def end_load(self, load: Load) -> None:
        """Unpin the slots of a ``begin_load``."""

    @abc.abstractmethod
    def lease(
        self, lease_id: str, owner: str, expires_unix_ms: int, key: LayoutKey, hashes: np.ndarray
    ) -> int:
        """Pin the leading held pages of ``hashes`` under ``lease_id`` (added to it if it exists);
        returns pages pinned."""

    @abc.abstractmethod
    def release_lease(self, lease_id: str, owner: str) -> bool:
        """Unpin a lease; False when the tier has no such lease, PermissionDenied when it is another
        owner's."""

    @abc.abstractmethod
    def release_owner(self, owner: str) -> int:
        """Unpin every lease of ``owner`` (its session ended); returns leases released."""

    @abc.abstractmethod
    def expire_leases(self, now_ms: int | None = None) -> int:
        """Unpin leases whose expiry is <= now; returns leases released."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """Counters and sizes."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError when an invariant of the module docstring does not hold."""
