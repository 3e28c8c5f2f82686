"""Lease bookkeeping: which entries each lease pins, who owns it, when it expires.

A lease remembers, per buffer set, the pinned slots and each slot's EPOCH at pin time. A slot
whose entry was evicted is FREE or was reused with a higher epoch: that is how a lease learns
its pages were evicted (the "detach" policy of ``base``) without the evictor knowing leases.
"""

from __future__ import annotations

import collections
import dataclasses
import uuid

import numpy as np

from kvservice.errors import FailedPrecondition, NotFound, PermissionDenied

from . import _kernels as K
from ._bufset import BufferSetIndex


@dataclasses.dataclass(frozen=True)
class LeasePart:
    buffer_set_id: str
    slots: np.ndarray  # int32
    epochs: np.ndarray  # int32
    pages: np.ndarray  # int32, the page indices as matched


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    lease_id: str
    owner: str
    expires_unix_ms: int
    parts: tuple[LeasePart, ...]


def live_mask(bs: BufferSetIndex, part: LeasePart) -> np.ndarray:
    """Which of the part's slots still hold the entry that was pinned."""
    rows = bs.E[part.slots]
    return (rows[:, K.PARENT] != K.FREE) & (rows[:, K.EPOCH] == part.epochs)


class LeaseBook:
    """Leases by id; pins are applied to and removed from the buffer sets' PINS column."""

    def __init__(self) -> None:
        self.leases: dict[str, LeaseRecord] = {}
        self.per_owner: collections.Counter[str] = collections.Counter()  # live leases by session

    def __len__(self) -> int:
        return len(self.leases)

    def add(
        self, owner: str, expires_unix_ms: int, parts: list[LeasePart], sets: dict[str, BufferSetIndex]
    ) -> LeaseRecord:
        for part in parts:
            sets[part.buffer_set_id].E[part.slots, K.PINS] += 1
        rec = LeaseRecord(uuid.uuid4().hex, owner, expires_unix_ms, tuple(parts))
        self.leases[rec.lease_id] = rec
        self.per_owner[owner] += 1
        return rec

    def get(self, lease_id: str, owner: str) -> LeaseRecord:
        rec = self.leases.get(lease_id)
        if rec is None:
            raise NotFound(f"lease {lease_id!r} is unknown, released or expired")
        if rec.owner != owner:
            raise PermissionDenied(f"lease {lease_id!r} belongs to another session")
        return rec

    def check(self, rec: LeaseRecord, sets: dict[str, BufferSetIndex]) -> None:
        for part in rec.parts:
            bs = sets.get(part.buffer_set_id)
            if bs is None:
                raise FailedPrecondition(f"lease {rec.lease_id}: buffer set {part.buffer_set_id} was removed")
            gone = part.pages[~live_mask(bs, part)]
            if gone.size:
                raise FailedPrecondition(
                    f"lease {rec.lease_id}: pages {gone[:8].tolist()}{'...' if gone.size > 8 else ''} "
                    f"of buffer set {part.buffer_set_id} were evicted after the lease was taken"
                )

    def release(self, lease_id: str, sets: dict[str, BufferSetIndex]) -> None:
        rec = self.leases.pop(lease_id)
        self.per_owner[rec.owner] -= 1
        if not self.per_owner[rec.owner]:
            del self.per_owner[rec.owner]
        for part in rec.parts:
            bs = sets.get(part.buffer_set_id)
            if bs is not None:
                slots = part.slots[live_mask(bs, part)]
                bs.E[slots, K.PINS] -= 1

    def release_where(self, pred: object, sets: dict[str, BufferSetIndex]) -> int:
        ids = [i for i, r in self.leases.items() if pred(r)]  # type: ignore[operator]
        for i in ids:
            self.release(i, sets)
        return len(ids)

    def expected_pins(self, sets: dict[str, BufferSetIndex]) -> dict[str, np.ndarray]:
        """Pins per slot implied by the live leases (for ``check_integrity``)."""
        out = {k: np.zeros(bs.E.shape[0], np.int64) for k, bs in sets.items()}
        for rec in self.leases.values():
            for part in rec.parts:
                bs = sets.get(part.buffer_set_id)
                if bs is not None:
                    np.add.at(out[part.buffer_set_id], part.slots[live_mask(bs, part)], 1)
        return out
