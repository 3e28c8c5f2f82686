"""P/D duplicate marks: pages a DONE transfer copied to a receiver that indexes them.

Seed 002 found that prefill and decode often both hold a prefix (the "P/D duplicate") while
the prefill cache is short of room. After a sender-side transfer ends DONE and the receiver
published the pages into its index (ExpectDelta with publish; its plan says ``publishes``),
the sending service marks the sent pages in its own index as also held there, and the policy
(``duplicate_policy``) lowers their eviction priority: SuggestEvictions then offers them first.
A SendDelta with ``no_duplicate_mark`` is never marked: its router will send the conversation's
next turn back to the sending engine, which then needs the pages itself.

A mark must never outlive the receiver's copy, or a prefill engine would drop the last copy
believing another exists. The receiver keeps no state for it: every ``duplicate_check_ms`` the
sender asks each receiver's service ``HeldPages(buffer set, hashes)`` and clears the marks of
pages it no longer holds. A receiver buffer set that is gone (NOT_FOUND), a service that does
not answer within the call timeout, or one that answers with another service id (it restarted)
clears every mark on it. So a mark is cleared at most one period plus one call timeout after
the receiver's copy went; SuggestEvictions also re-checks the marks of the buffer set it is
asked about before answering, so a page suggested as duplicated was held a moment ago.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from typing import TYPE_CHECKING

import numpy as np

from ..errors import KVServiceError
from .records import Record

if TYPE_CHECKING:
    from .engine import TransferEngine

__all__ = ["DuplicateBook", "Mark"]

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0


@dataclasses.dataclass(eq=False)
class Mark:
    """Entries of one source buffer set also held by the receiver ranks of one transfer."""

    mark_id: int
    src_bs: str
    slots: np.ndarray
    epochs: np.ndarray
    hashes: np.ndarray
    address: str  # the receiver's service
    service_id: str  # its id at the transfer (another id later: it restarted)
    targets: tuple[str, ...]  # receiver buffer sets; a page counts only if every one holds it


def _ids(slots: np.ndarray, epochs: np.ndarray) -> np.ndarray:
    """One int64 per (slot, epoch): an index entry's identity."""
    return (slots.astype(np.int64) << 32) | epochs.astype(np.int64)


class DuplicateBook:
    """Sender-side marks, checked against the receivers' services. Runs on the event loop."""

    def __init__(self, engine: TransferEngine) -> None:
        self._e = engine
        cfg = engine.config
        self.policy: str = cfg.index.duplicate_policy
        self.dup_priority: int | None = cfg.index.duplicate_priority if self.policy == "lower" else None
        self.period_s = cfg.index.duplicate_check_ms / 1000
        self.marks: dict[int, Mark] = {}
        # One mark per (source set, receiver service, receiver sets): a prefix sent again to the
        # same receiver extends its mark instead of stacking another (bounded by the index).
        self._by_key: dict[tuple[str, str, tuple[str, ...]], Mark] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._checking = asyncio.Lock()  # one check at a time: a check mutates the marks it read
        self.cleared = 0  # marks (or parts) cleared because the receiver's copy went
        if self.policy != "off":
            engine.table.terminal_listeners.append(self._ended)

    def start(self) -> None:
        if self.policy != "off":
            self._task = asyncio.get_running_loop().create_task(self._run(), name="duplicate-checks")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for m in list(self.marks.values()):
            self._drop(m)

    # -- marking -----------------------------------------------------------------------------
    def _ended(self, rec: Record) -> None:
        """A transfer side ended: a DONE sender whose receivers publish marks its pages."""
        if rec.role != "SENDER" or rec.state != "DONE":
            return
        out = self._e.sender.outgoing.get((rec.transfer_id, rec.buffer_set_id))
        if out is None or not out.targets or not out.sent_src or out.no_duplicate_mark:
            return
        if not all(t.plan.publishes for t in out.targets):
            return  # the receiver does not index them: its copy could not be tracked
        targets = tuple(t.plan.dst_buffer_set_id for t in out.targets)
        self.mark(rec.buffer_set_id, np.concatenate(out.sent_src), out.peer_address, targets)

    def mark(self, src_bs: str, pages: np.ndarray, address: str, targets: tuple[str, ...]) -> None:
        """``pages`` of ``src_bs`` are now also held by ``targets`` at the service at ``address``
        (a DONE transfer whose receivers publish; the gRPC route's and the cross-node lane's)."""
        if self.policy == "off":
            return
        index = self._e.index
        try:
            slots, epochs, hashes = index.mark_duplicates(src_bs, pages)
        except KVServiceError:  # the buffer set went meanwhile
            return
        key = (src_bs, address, targets)
        old = self._by_key.get(key)
        if old is not None:  # entries it already marks count once
            known = np.isin(_ids(slots, epochs), _ids(old.slots, old.epochs))
            index.unmark_duplicates(src_bs, slots[known], epochs[known])
            slots, epochs, hashes = slots[~known], epochs[~known], hashes[~known]
        if not slots.size:
            return
        if old is not None:
            old.slots = np.concatenate([old.slots, slots])
            old.epochs = np.concatenate([old.epochs, epochs])
            old.hashes = np.concatenate([old.hashes, hashes])
        else:
            m = Mark(
                next(self._ids),
                src_bs,
                slots,
                epochs,
                hashes,
                address,
                self._e.peers.get(address).service_id,
                targets,
            )
            self.marks[m.mark_id] = self._by_key[key] = m
        self._e.notices.duplicates(src_bs)

    def _drop(self, m: Mark, keep: np.ndarray | None = None) -> None:
        """Clear ``m`` entirely, or only the entries where ``keep`` is False."""
        gone = slice(None) if keep is None else ~keep
        self._e.index.unmark_duplicates(m.src_bs, m.slots[gone], m.epochs[gone])
        if keep is None or not keep.any():
            self._forget(m)
        else:
            m.slots, m.epochs, m.hashes = m.slots[keep], m.epochs[keep], m.hashes[keep]
        self.cleared += 1

    def _forget(self, m: Mark) -> None:
        self.marks.pop(m.mark_id, None)
        key = (m.src_bs, m.address, m.targets)
        if self._by_key.get(key) is m:
            del self._by_key[key]

    def drop_buffer_set(self, buffer_set_id: str) -> None:
        """The source buffer set was unregistered: its marks go with it."""
        for m in [m for m in self.marks.values() if m.src_bs == buffer_set_id]:
            self._forget(m)

    # -- checking ----------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.check()
            except Exception:  # never let the loop die; the next period retries
                log.exception("duplicate mark check failed")

    async def check(self, src_bs: str | None = None) -> None:
        """Ask the receivers whether they still hold the marked pages (of ``src_bs`` only, if
        given); clear what they do not. One HeldPages call per receiver buffer set."""
        async with self._checking:
            await self._check(src_bs)

    async def _check(self, src_bs: str | None) -> None:
        index = self._e.index
        changed: set[str] = set()  # source sets whose owners are told once, at the end
        for m in [m for m in self.marks.values() if src_bs is None or m.src_bs == src_bs]:
            alive = index.entries_alive(m.src_bs, m.slots, m.epochs)
            if not alive.all():  # this service evicted (or reused) them: nothing left to check
                self._drop(m, alive)
                changed.add(m.src_bs)
        marks = [m for m in self.marks.values() if src_bs is None or m.src_bs == src_bs]
        asked = {m.mark_id: m.hashes for m in marks}  # a mark shrunk meanwhile is checked next time
        by_target: dict[tuple[str, str], list[Mark]] = {}
        for m in marks:
            for t in m.targets:
                by_target.setdefault((m.address, t), []).append(m)
        answers = await asyncio.gather(*(self._held(addr, t, ms) for (addr, t), ms in by_target.items()))
        held: dict[int, np.ndarray] = {}
        for ms, per_mark in zip(by_target.values(), answers, strict=True):
            for m, mask in zip(ms, per_mark, strict=True):
                held[m.mark_id] = mask if m.mark_id not in held else held[m.mark_id] & mask
        for m in marks:
            got = held.get(m.mark_id)
            if m.mark_id in self.marks and got is not None and m.hashes is asked[m.mark_id] and not got.all():
                self._drop(m, got)
                changed.add(m.src_bs)
        for bs_id in changed:
            self._e.notices.duplicates(bs_id)

    async def _held(self, address: str, target: str, marks: list[Mark]) -> list[np.ndarray]:
        """Per mark, which of its hashes the receiver buffer set ``target`` holds (all False
        when the set, the service or its identity is gone)."""
        hashes = np.concatenate([m.hashes for m in marks])
        peer = self._e.peers.get(address)
        try:
            mask, service_id = await peer.held_pages(target, hashes, CHECK_TIMEOUT_S)
            restarted = any(m.service_id and service_id != m.service_id for m in marks)
            if mask.size != hashes.size or restarted:
                mask = np.zeros(hashes.size, dtype=bool)
        except (KVServiceError, asyncio.TimeoutError) as exc:
            log.info("duplicate marks on %s/%s cleared: %s", address, target, exc)
            mask = np.zeros(hashes.size, dtype=bool)
        bounds = np.cumsum([0, *(m.hashes.size for m in marks)])
        return [mask[a:b] for a, b in itertools.pairwise(bounds)]
