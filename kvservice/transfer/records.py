"""Transfer records and the table that holds them, with change notification for watchers.

One record per (transfer_id, role, buffer_set_id): a receiver rank's declaration, or a sender
rank's outgoing transfer. State machine (terminal states are final; ``finish`` is idempotent)::

    PENDING ──▶ TRANSFERRING ──▶ DONE
       │             │      └──▶ FAILED  (error_code + error)
       └─────────────┴─────────▶ ABORTED (error_code + error)

A landing receiver (``kvservice.transfer.landing``) passes LANDED (live, not terminal) between
TRANSFERRING and DONE: its bytes are in the landing pool until a Claim copies them out.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from ..latest import LatestQueue
from . import trace

__all__ = ["PHASES", "TERMINAL", "Record", "TransferTable"]

log = logging.getLogger(__name__)
TERMINAL = frozenset({"DONE", "FAILED", "ABORTED"})
PHASES = ("queue", "plan", "pack", "wire", "unpack")
_Queue = LatestQueue[tuple[str, str, str], "Record"]  # a watcher's: newest snapshot per record


@dataclasses.dataclass
class Record:
    """Mutable state of one side of a transfer; mutate only through :class:`TransferTable`."""

    transfer_id: str
    role: str  # "SENDER" | "RECEIVER"
    buffer_set_id: str
    session_id: str
    deadline: float  # time.monotonic()
    created: float = dataclasses.field(default_factory=time.monotonic)
    state: str = "PENDING"
    bytes_sent: int = 0
    expected_bytes: int = 0  # receiver: KV and aux bytes the declaration waits for
    lane_told: bool = False  # the native lane gave this side's engine its END (kvservice.transfer.lane)
    pages_sent: int = 0
    pages_skipped: int = 0
    descriptors: int = 0
    chunks_done: int = 0
    senders_done: int = 0
    path: str = "AUTO"
    landing: bool = False  # a landing receiver (LANDED before DONE)
    route_note: str = ""
    timings_us: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    error_code: str = ""
    error: str = ""
    ended: float = 0.0
    updated_unix_ms: int = dataclasses.field(default_factory=lambda: int(time.time() * 1000))

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.transfer_id, self.role, self.buffer_set_id)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def total_us(self) -> int:
        end = self.ended or time.monotonic()
        return int((end - self.created) * 1e6)

    def snapshot(self) -> Record:
        return dataclasses.replace(self, timings_us=dict(self.timings_us))


class TransferTable:
    """Thread-safe table of records; every change is pushed to matching watchers.

    Terminal records are kept for ``retain_s`` so late Polls still see how a transfer ended.
    """

    def __init__(self, retain_s: float = 300.0) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[str, str, str], Record] = {}
        # NOTE: indexes so hot paths never scan retained (finished) records: live ones, by
        # transfer id, and finished ones in the order they will be pruned.
        self._live: dict[tuple[str, str, str], Record] = {}
        self._live_by_bs: dict[str, dict[tuple[str, str, str], Record]] = {}
        # NOTE: tuples, not sets: a tuple of strings leaves the cyclic GC's scans, and a
        # transfer has one or two keys (GC pauses grew with retained records)
        self._by_tid: dict[str, tuple[tuple[str, str, str], ...]] = {}
        self._ended: collections.deque[tuple[float, tuple[str, str, str]]] = collections.deque()
        self._watchers: list[tuple[asyncio.AbstractEventLoop, _Queue, Callable[[Record], bool]]] = []
        self.retain_s = retain_s
        # Told of every record that reaches a terminal state (metrics, the load book), outside
        # the lock; they must be quick.
        self.terminal_listeners: list[Callable[[Record], None]] = []
        # Per session: told of each of its records that reaches a terminal state (engines'
        # Transfers streams), outside the lock, on the thread that finished it.
        self._ended_subs: dict[str, list[Callable[[Record], None]]] = {}
        self.counts = {"DONE": 0, "FAILED": 0, "ABORTED": 0}
        self.live_per_session: collections.Counter[str] = collections.Counter()

    def add(self, rec: Record) -> Record:
        with self._lock:
            self._records[rec.key] = rec
            keys = self._by_tid.get(rec.transfer_id, ())
            if rec.key not in keys:
                self._by_tid[rec.transfer_id] = (*keys, rec.key)
            if not rec.terminal and rec.key not in self._live:
                self._live[rec.key] = rec
                self._live_by_bs.setdefault(rec.buffer_set_id, {})[rec.key] = rec
                self.live_per_session[rec.session_id] += 1
        self._publish(rec)
        return rec

    def get(self, key: tuple[str, str, str]) -> Record | None:
        with self._lock:
            return self._records.get(key)

    def find(self, transfer_id: str, role: str | None = None) -> list[Record]:
        with self._lock:
            recs = (self._records[k] for k in self._by_tid.get(transfer_id, ()))
            return [r for r in recs if role is None or r.role == role]

    def live(self) -> list[Record]:
        """Records not yet terminal."""
        with self._lock:
            return list(self._live.values())

    def live_of(self, buffer_set_id: str) -> list[Record]:
        """Records of one buffer set not yet terminal (O(its live records))."""
        with self._lock:
            return list(self._live_by_bs.get(buffer_set_id, {}).values())

    def select(self, pred: Callable[[Record], bool]) -> list[Record]:
        with self._lock:
            return [r for r in self._records.values() if pred(r)]

    def update(self, rec: Record, **changes: object) -> None:
        """Apply changes (ignored once terminal); 'add_*' keys add to counters/timings."""
        with self._lock:
            if rec.terminal:
                return
            for k, v in changes.items():
                if k.startswith("add_"):
                    name = k[4:]
                    if name in rec.timings_us:
                        rec.timings_us[name] += int(v)  # type: ignore[call-overload]
                    else:
                        setattr(rec, name, getattr(rec, name) + v)
                else:
                    setattr(rec, k, v)
            rec.updated_unix_ms = int(time.time() * 1000)
        self._publish(rec)

    def finish(self, rec: Record, state: str, code: str = "", error: str = "") -> bool:
        """Move to a terminal state once; returns False if it already was terminal."""
        with self._lock:
            if rec.terminal:
                return False
            rec.state, rec.error_code, rec.error = state, code, error
            rec.ended = time.monotonic()
            if self._live.pop(rec.key, None) is not None:
                per_bs = self._live_by_bs[rec.buffer_set_id]
                del per_bs[rec.key]
                if not per_bs:
                    del self._live_by_bs[rec.buffer_set_id]
                self.live_per_session[rec.session_id] -= 1
                if not self.live_per_session[rec.session_id]:
                    del self.live_per_session[rec.session_id]
            self._ended.append((rec.ended, rec.key))
            rec.updated_unix_ms = int(time.time() * 1000)
            self.counts[state] += 1
        trace.mark(rec.transfer_id, f"{rec.role}_{state}")
        for sub in self._ended_subs.get(rec.session_id, ()):
            sub(rec)
        self._publish(rec)
        # NOTE: the engines' events go out first: the log line and the listeners (metrics, load
        # book, recent transfers: ~0.2 ms) run one loop turn later, after the stream writers.
        try:
            asyncio.get_running_loop().call_soon(self._report, rec, state, code, error)
        except RuntimeError:  # not on a loop (a thread, a test)
            self._report(rec, state, code, error)
        return True

    def _report(self, rec: Record, state: str, code: str, error: str) -> None:
        level = logging.INFO if state == "DONE" else logging.WARNING
        log.log(
            level,
            "transfer %s",
            state.lower(),
            extra={
                "transfer_id": rec.transfer_id,
                "role": rec.role,
                "buffer_set_id": rec.buffer_set_id,
                "error_code": code,
                "error": error,
                "bytes": rec.bytes_sent,
                "pages_sent": rec.pages_sent,
                "pages_skipped": rec.pages_skipped,
                "total_us": rec.total_us,
            },
        )
        for listener in self.terminal_listeners:
            listener(rec)

    def subscribe(self, session_id: str, fn: Callable[[Record], None]) -> Callable[[], None]:
        """Call ``fn(record)`` whenever a record of ``session_id`` reaches a terminal state (the
        record itself: it no longer changes); returns the unsubscribe function."""
        with self._lock:
            self._ended_subs.setdefault(session_id, []).append(fn)

        def unsubscribe() -> None:
            with self._lock:
                subs = self._ended_subs.get(session_id, [])
                if fn in subs:
                    subs.remove(fn)
                if not subs:
                    self._ended_subs.pop(session_id, None)

        return unsubscribe

    def in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    def prune(self) -> list[tuple[str, str, str]]:
        """Forget records finished more than ``retain_s`` ago; returns their keys."""
        cutoff = time.monotonic() - self.retain_s
        gone = []
        with self._lock:
            while self._ended and self._ended[0][0] < cutoff:
                _, key = self._ended.popleft()
                rec = self._records.get(key)
                if rec is None or not rec.terminal or rec.ended >= cutoff:
                    continue  # replaced by a newer record under the same key
                del self._records[key]
                left = tuple(k for k in self._by_tid.get(key[0], ()) if k != key)
                if left:
                    self._by_tid[key[0]] = left
                else:
                    self._by_tid.pop(key[0], None)
                gone.append(key)
        return gone

    # -- watchers --------------------------------------------------------------------------
    async def watch(self, pred: Callable[[Record], bool], include_current: bool) -> AsyncIterator[Record]:
        """Yield snapshots of matching records as they change (current ones first if asked).
        A watcher slower than the changes gets each record's latest snapshot once (bounded by
        the records it matches; a terminal state is always the last one it sees)."""
        loop = asyncio.get_running_loop()
        queue: _Queue = LatestQueue()
        entry = (loop, queue, pred)
        with self._lock:
            self._watchers.append(entry)
            current = [r.snapshot() for r in self._records.values() if pred(r)] if include_current else []
        try:
            for rec in current:
                yield rec
            while True:
                yield (await queue.get())[1]
        finally:
            with self._lock:
                self._watchers.remove(entry)

    def _publish(self, rec: Record) -> None:
        if not self._watchers:  # NOTE: the hot path: no watcher, no snapshot, no lock
            return
        with self._lock:
            targets = [(loop, q) for loop, q, pred in self._watchers if pred(rec)]
        if not targets:
            return
        snap = rec.snapshot()
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for loop, q in targets:
            if loop is here:  # no self-pipe write (a syscall) when we are on the watcher's loop
                q.put(snap.key, snap)
            else:
                loop.call_soon_threadsafe(q.put, snap.key, snap)
