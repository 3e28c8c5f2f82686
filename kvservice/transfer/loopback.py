"""Same-process double of :class:`Transport`: WRITEs are ``ctypes.memmove`` between addresses.

Agents live in one process and find each other by name in a process-wide registry. It follows
NIXL's observable contract, so the contract tests run against both:

- ``metadata()`` is a snapshot: a peer only sees memory registered before it was taken, and
  ``prep_remote`` rejects descriptors outside the snapshot (TransportError, as NIXL does).
- ``prep_local`` rejects descriptors outside this agent's registered memory.
- A notification is delivered after the transfer's bytes, keyed by the sender's ``str`` name.
- ``polls_to_complete=n`` keeps every handle in ``PROC`` for ``n`` ``status`` calls; its bytes are
  copied when it turns ``DONE``, never before, and never once its peer was removed (``ERR``).
  With 0, ``write`` copies at once and the handle is ``DONE``.

Thread-safety: one lock per agent guards its tables; copies run outside it.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from ..errors import NotFound, TransportError
from .descriptors import ListGeometry
from .transport import (
    LocalDescList,
    MemKind,
    RegHandle,
    RemoteDescList,
    Transport,
    XferHandle,
    XferState,
    check_write,
)

__all__ = ["LoopbackTransport"]

_AGENTS: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_AGENTS_LOCK = threading.Lock()


@dataclass
class _Pending:
    src: np.ndarray  # (N, 3) [addr, len, dev] merged copy list
    dst: np.ndarray
    peer: str
    notif: bytes | None
    polls_left: int
    state: XferState = "PROC"


def _inside(geo: ListGeometry, spans: list[tuple[int, int]]) -> bool:
    """True iff every row of ``geo`` lies within one of ``spans`` ([start, end) bytes)."""
    rows = geo.spans()
    ok = np.zeros(rows.shape[0], dtype=bool)
    for start, end in spans:
        ok |= (rows[:, 0] >= start) & (rows[:, 1] <= end)
    return bool(ok.all())


def _merge(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge neighbours contiguous on both sides (as NIXL does) so runs cost one memmove."""
    if src.shape[0] < 2:
        return src, dst
    cont = (src[:-1, 0] + src[:-1, 1] == src[1:, 0]) & (dst[:-1, 0] + dst[:-1, 1] == dst[1:, 0])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lens = np.add.reduceat(src[:, 1], starts)
    s, d = src[starts].copy(), dst[starts].copy()
    s[:, 1] = lens
    d[:, 1] = lens
    return s, d


class LoopbackTransport(Transport):
    kind = "loopback"

    def __init__(self, name: str, polls_to_complete: int = 0) -> None:
        with _AGENTS_LOCK:
            if name in _AGENTS:
                raise TransportError(f"create agent: loopback agent {name!r} already exists")
            _AGENTS[name] = self
        self._name = name
        self._polls = polls_to_complete
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._regs: dict[int, RegHandle] = {}
        self._peers: dict[str, list[tuple[int, int]]] = {}
        self._lists: dict[int, tuple[ListGeometry, str | None]] = {}
        self._xfers: dict[int, _Pending] = {}
        self._inbox: dict[str, list[bytes]] = {}

    @property
    def agent_name(self) -> str:
        return self._name

    def metadata(self) -> bytes:
        with self._lock:
            spans = [[r.addr, r.addr + r.size] for r in self._regs.values()]
        return json.dumps({"loopback": self._name, "spans": spans}).encode()

    def add_peer(self, name: str, metadata: bytes) -> str:
        try:
            blob = json.loads(metadata)
            got, spans = str(blob["loopback"]), [(int(a), int(b)) for a, b in blob["spans"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"add_peer: metadata is not a loopback blob ({exc})") from exc
        if got != name:
            raise TransportError(f"add_peer: metadata is of agent {got!r}, expected {name!r}")
        with self._lock:
            self._peers[name] = spans
        return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            self._peers.pop(name, None)
            for x in self._xfers.values():
                if x.peer == name and x.state == "PROC":
                    x.state = "ERR"

    def register(self, addr: int, size: int, mem_kind: MemKind, device_id: int) -> RegHandle:
        if mem_kind != "DRAM":
            raise TransportError(f"register: loopback moves DRAM only, not {mem_kind}")
        if addr <= 0 or size <= 0:
            raise TransportError("register: address and size must be > 0")
        with self._lock:
            handle = RegHandle(next(self._ids), addr, size, mem_kind, device_id)
            self._regs[handle.id] = handle
        return handle

    def deregister(self, handle: RegHandle) -> None:
        with self._lock:
            if self._regs.pop(handle.id, None) is None:
                raise NotFound(f"registration {handle.id} is not known")

    def prep_local(self, regions: np.ndarray, mem_kind: MemKind = "DRAM") -> LocalDescList:
        geo = ListGeometry.of(regions)
        with self._lock:
            if not _inside(geo, [(r.addr, r.addr + r.size) for r in self._regs.values()]):
                raise TransportError("prep: descriptors outside registered local memory")
            lid = next(self._ids)
            self._lists[lid] = (geo, None)
        return LocalDescList(lid, mem_kind, geo.count)

    def prep_remote(self, peer: str, regions: np.ndarray, mem_kind: MemKind = "DRAM") -> RemoteDescList:
        geo = ListGeometry.of(regions)
        with self._lock:
            if peer not in self._peers:
                raise NotFound(f"peer {peer!r} is not known")
            if not _inside(geo, self._peers[peer]):
                raise TransportError(f"prep: descriptors outside memory registered by {peer!r}")
            lid = next(self._ids)
            self._lists[lid] = (geo, peer)
        return RemoteDescList(lid, peer, mem_kind, geo.count)

    def release_list(self, dlist: LocalDescList | RemoteDescList) -> None:
        with self._lock:
            self._lists.pop(dlist.id, None)

    def _geo(self, dlist: LocalDescList | RemoteDescList) -> ListGeometry:
        with self._lock:
            entry = self._lists.get(dlist.id)
        if entry is None:
            raise NotFound(f"descriptor list {dlist.id} is not known")
        return entry[0]

    def write(
        self,
        local: LocalDescList,
        local_idx: np.ndarray,
        remote: RemoteDescList,
        remote_idx: np.ndarray,
        notif: bytes | None = None,
    ) -> XferHandle:
        lgeo, rgeo = self._geo(local), self._geo(remote)
        li, ri, nbytes = check_write(lgeo, local_idx, rgeo, remote_idx)
        src, dst = lgeo.select(li.astype(np.int64)), rgeo.select(ri.astype(np.int64))
        return self._post(remote.peer, src, dst, notif, nbytes)

    def write_descs(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        notif: bytes | None = None,
        mem_kind: MemKind = "DRAM",
        remote_mem_kind: MemKind = "DRAM",
    ) -> XferHandle:
        lgeo, rgeo = ListGeometry.of(local), ListGeometry.of(remote)
        _, _, nbytes = check_write(lgeo, np.arange(lgeo.count), rgeo, np.arange(rgeo.count))
        with self._lock:
            spans = self._peers.get(peer)
            mine = [(r.addr, r.addr + r.size) for r in self._regs.values()]
        if spans is None:
            raise NotFound(f"peer {peer!r} is not known")
        if not (_inside(lgeo, mine) and _inside(rgeo, spans)):
            raise TransportError("write_descs: descriptors outside registered memory")
        src, dst = lgeo.select(np.arange(lgeo.count)), rgeo.select(np.arange(rgeo.count))
        return self._post(peer, src, dst, notif, nbytes)

    def _post(
        self, peer: str, src: np.ndarray, dst: np.ndarray, notif: bytes | None, nbytes: int
    ) -> XferHandle:
        with self._lock:
            if peer not in self._peers:
                raise NotFound(f"peer {peer!r} is not known")
        s, d = _merge(src, dst)
        pending = _Pending(s, d, peer, notif, self._polls)
        handle = XferHandle(next(self._ids), peer, int(src.shape[0]), nbytes)
        with self._lock:
            self._xfers[handle.id] = pending
        if pending.polls_left == 0:
            self._complete(pending)
        return handle

    def _complete(self, x: _Pending) -> None:
        with self._lock:
            if x.state != "PROC":
                return
            target = _AGENTS.get(x.peer)
            if target is None:
                x.state = "ERR"
                return
            x.state = "DONE"
            # NOTE: copy under our lock so remove_peer cannot interleave with a landing write.
            for (sa, n, _), (da, _, _) in zip(x.src.tolist(), x.dst.tolist(), strict=True):
                ctypes.memmove(da, sa, n)
        if x.notif is not None:
            target._deliver(self._name, x.notif)

    def _deliver(self, sender: str, message: bytes) -> None:
        with self._lock:
            self._inbox.setdefault(sender, []).append(bytes(message))

    def status(self, handle: XferHandle) -> XferState:
        with self._lock:
            x = self._xfers.get(handle.id)
            if x is None:
                raise NotFound(f"transfer handle {handle.id} is not known")
            if x.state == "PROC" and x.polls_left > 0:
                x.polls_left -= 1
            due = x.state == "PROC" and x.polls_left == 0
        if due:
            self._complete(x)
        return x.state

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            self._xfers.pop(handle.id, None)

    def notifications(self) -> dict[str, list[bytes]]:
        with self._lock:
            inbox, self._inbox = self._inbox, {}
        return inbox

    def send_notif(self, peer: str, message: bytes) -> None:
        with self._lock:
            known = peer in self._peers
        target = _AGENTS.get(peer)
        if not known or target is None:
            raise NotFound(f"peer {peer!r} is not known")
        target._deliver(self._name, message)

    def close(self) -> None:
        with self._lock:
            self._xfers.clear()
            self._lists.clear()
            self._regs.clear()
            self._peers.clear()
        with _AGENTS_LOCK:
            if _AGENTS.get(self._name) is self:
                del _AGENTS[self._name]
