"""The data-transport interface: one-sided WRITEs of registered memory to a peer's memory.

This module is the specification; ``nixl_transport.py`` (NIXL/UCX, the only module that imports
``nixl``) and ``loopback.py`` (same-process ``memmove`` double) implement it and pass the same
contract tests (``tests/transfer/test_transport_contract.py``).

Life cycle, one transport per service process::

    t.register(addr, size, "DRAM", 0)        every region a peer may write into or read from
    blob = t.metadata()                       AFTER registering: the blob lists registered memory
    peer = t.add_peer(name, their_blob)       from the peer's Handshake; again after it re-registers
    lst = t.prep_local(regions)               once per registered region set, reused every transfer
    rem = t.prep_remote(peer, regions)        regions: (N, 3) [addr, len, dev] or (N, 5) strided
    h = t.write(lst, li, rem, ri, notif)      li/ri: index arrays into the prepped lists
    await t.wait(h, deadline)                 settles and releases h in every outcome

Prepped-list indexing: an (N, 5) row ``(addr, len, dev, stride, count)`` stands for ``count``
elements ``addr + k*stride`` of ``len`` bytes; elements are numbered row-major::

    row 0 (K layer 0): idx 0 .. P-1      row 1 (K layer 1): idx P .. 2P-1   ...

so with one row per region and ``P`` pages each, page ``p`` of region ``r`` is ``r*P + p``
(``descriptors.prepped_indices`` computes these arrays).

Deadlines and aborts are ours: NIXL has neither a per-transfer timeout nor a real cancel.
``release`` of a handle that is still ``PROC`` is NOT a cancel we can rely on: measured with
NIXL 1.5.1/UCX tcp, the release returns and the bytes still land. So the rule, and what
``wait``/``settle`` implement, is: an abort is acknowledged only after every handle of the
transfer has left ``PROC`` (``DONE`` or ``ERR``); if a handle stays in ``PROC`` past the settle
bound, the peer is removed (UCX closes the endpoint, outstanding operations fail with ``ERR``)
and we poll again. A handle that still cannot be settled raises :class:`TransportError` and is
not released: its memory must stay registered and the abort must not be acknowledged.

Errors: every failure of the lower layer is raised as :class:`TransportError`; unknown handles
or lists raise :class:`NotFound`; malformed arguments raise :class:`InvalidArgument`.

Thread-safety: every method may be called from any thread. ``write`` may block its thread for
the whole transfer on some transports (UCX cma completes inside the post), so call it from a
worker thread, never from the event loop. ``notifications`` drains a single inbox: have one
consumer.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..errors import DeadlineExceeded, InvalidArgument, TransportError
from ..kernels import completions
from .descriptors import ListGeometry

__all__ = [
    "LocalDescList",
    "MemKind",
    "RegHandle",
    "RemoteDescList",
    "Transport",
    "XferHandle",
    "XferState",
    "check_write",
]

MemKind = Literal["DRAM", "VRAM"]
XferState = Literal["PROC", "DONE", "ERR"]

_STOP_CHECK_S = 5e-3  # how often a wait looks at its ``stopped`` (an Abort) while it sleeps


@dataclass(frozen=True)
class RegHandle:
    """A registered memory region; pass it back to ``deregister``."""

    id: int
    addr: int
    size: int
    mem_kind: MemKind
    device_id: int


@dataclass(frozen=True)
class LocalDescList:
    """A prepared list of local descriptors; ``count`` elements addressable by index."""

    id: int
    mem_kind: MemKind
    count: int


@dataclass(frozen=True)
class RemoteDescList:
    """A prepared list of a peer's descriptors; ``count`` elements addressable by index."""

    id: int
    peer: str
    mem_kind: MemKind
    count: int


@dataclass(frozen=True)
class XferHandle:
    """A posted transfer. ``descriptors`` counts the requested elements (before merging)."""

    id: int
    peer: str
    descriptors: int
    nbytes: int


def check_write(
    local: ListGeometry, local_idx: np.ndarray, remote: ListGeometry, remote_idx: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate a ``write``'s index arrays; return them as int32 and the byte count.

    Shared by the implementations so both reject the same calls with the same errors.
    """
    out = []
    for name, geo, idx in (("local_idx", local, local_idx), ("remote_idx", remote, remote_idx)):
        arr = np.asarray(idx)
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise InvalidArgument(name, "must be a non-empty 1-D integer array")
        if arr.min() < 0 or arr.max() >= geo.count:
            raise InvalidArgument(name, f"indices must be in 0..{geo.count - 1}")
        out.append(arr.astype(np.int32, copy=False))
    li, ri = out
    if li.size != ri.size:
        raise InvalidArgument("remote_idx", f"length {ri.size} differs from local_idx length {li.size}")
    lens = local.select(li.astype(np.int64))[:, 1]
    if not np.array_equal(lens, remote.select(ri.astype(np.int64))[:, 1]):
        raise InvalidArgument("remote_idx", "element lengths differ between local and remote")
    return li, ri, int(lens.sum())


class Transport(abc.ABC):
    """One-sided WRITE transport between named agents. See the module docstring."""

    kind: str = "abstract"

    @property
    @abc.abstractmethod
    def agent_name(self) -> str:
        """This agent's name, unique among the peers (sent in ``Handshake.agent_name``)."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Opaque blob a peer passes to ``add_peer``; it includes the memory registered so far."""

    @abc.abstractmethod
    def add_peer(self, name: str, metadata: bytes) -> str:
        """Load a peer's metadata (replacing any earlier one) and return its name as ``str``.

        Raises TransportError when the blob is unusable or names an agent other than ``name``.
        """

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect; its in-flight handles fail (``ERR``). Unknown: no-op."""

    @abc.abstractmethod
    def register(self, addr: int, size: int, mem_kind: MemKind, device_id: int) -> RegHandle:
        """Register ``[addr, addr+size)`` so it can be a source or a destination."""

    @abc.abstractmethod
    def deregister(self, handle: RegHandle) -> None:
        """Deregister; no handle using the region may be in flight. Raises NotFound if unknown."""

    @abc.abstractmethod
    def prep_local(self, regions: np.ndarray, mem_kind: MemKind = "DRAM") -> LocalDescList:
        """Prepare local descriptors from an (N, 3) or (N, 5) int64 array (see module doc).

        Every element must lie inside registered memory (checked here or at ``write``).
        """

    @abc.abstractmethod
    def prep_remote(self, peer: str, regions: np.ndarray, mem_kind: MemKind = "DRAM") -> RemoteDescList:
        """Prepare descriptors of ``peer``'s registered memory (addresses in its space)."""

    @abc.abstractmethod
    def release_list(self, dlist: LocalDescList | RemoteDescList) -> None:
        """Free a prepared list; handles built from it must be released first."""

    @abc.abstractmethod
    def write(
        self,
        local: LocalDescList,
        local_idx: np.ndarray,
        remote: RemoteDescList,
        remote_idx: np.ndarray,
        notif: bytes | None = None,
    ) -> XferHandle:
        """Post a WRITE of ``local[local_idx[i]]`` to ``remote[remote_idx[i]]`` for every ``i``.

        Index arrays are 1-D, equal length, in range; element ``i`` of both sides has the same
        length. ``notif`` is delivered to the peer's ``notifications()`` after all bytes landed.
        The transfer may already be ``DONE`` on return.
        """

    @abc.abstractmethod
    def write_descs(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        notif: bytes | None = None,
        mem_kind: MemKind = "DRAM",
        remote_mem_kind: MemKind = "DRAM",
    ) -> XferHandle:
        """Post a WRITE from raw (N, 3) ``[addr, len, dev]`` arrays (staging slots, one-offs)."""

    @abc.abstractmethod
    def status(self, handle: XferHandle) -> XferState:
        """``PROC`` while bytes may still land, then ``DONE`` or ``ERR`` for good."""

    @abc.abstractmethod
    def release(self, handle: XferHandle) -> None:
        """Free a handle. Call only once it left ``PROC`` (see ``settle``). Unknown: no-op."""

    @abc.abstractmethod
    def notifications(self) -> dict[str, list[bytes]]:
        """Drain notifications received since the last call: peer name (str) → messages."""

    @abc.abstractmethod
    def send_notif(self, peer: str, message: bytes) -> None:
        """Send a notification not bound to a transfer."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release lists, deregister memory, drop peers. Idempotent."""

    async def settle(self, handle: XferHandle, timeout_s: float = 5.0) -> XferState:
        """Wait until ``handle`` left ``PROC`` (disconnecting its peer if needed), then release it.

        After this returns no byte of ``handle`` can land any more. Raises TransportError (and
        keeps the handle) if it is still ``PROC`` after the peer was removed.
        """
        state = await self.poll_until(handle, time.monotonic() + timeout_s)
        if state == "PROC":
            self.remove_peer(handle.peer)
            state = await self.poll_until(handle, time.monotonic() + timeout_s)
        if state == "PROC":
            raise TransportError(
                f"transfer {handle.id} to {handle.peer} did not settle; memory must stay registered"
            )
        self.release(handle)
        return state

    async def wait(self, handle: XferHandle, deadline: float, settle_s: float = 5.0) -> None:
        """Wait for ``handle`` until ``deadline`` (``time.monotonic()`` seconds); release it.

        Returns on DONE. Raises TransportError on ERR, and DeadlineExceeded at the deadline
        after settling the handle (so no byte lands once this raised).
        """
        state = await self.poll_until(handle, deadline)
        if state == "PROC":
            await self.settle(handle, settle_s)
            raise DeadlineExceeded(f"transfer {handle.id} to {handle.peer} past its deadline")
        self.release(handle)
        if state == "ERR":
            raise TransportError(f"transfer {handle.id} to {handle.peer} failed")

    async def poll_until(
        self, handle: XferHandle, deadline: float, stopped: Callable[[], bool] | None = None
    ) -> XferState:
        """``handle``'s state once it left ``PROC``, or at ``deadline`` or once ``stopped()`` (it
        may still be ``PROC`` then). A poller thread watches the request (``completions.polled``):
        the loop sleeps meanwhile, waking every ``_STOP_CHECK_S`` only to look at ``stopped``."""
        fut = completions.polled(lambda: self.status(handle) != "PROC", ("transport", id(self)))
        try:
            while not fut.done():
                left = deadline - time.monotonic()
                if left <= 0 or (stopped is not None and stopped()):
                    break
                await asyncio.wait({fut}, timeout=min(left, _STOP_CHECK_S))
        finally:
            if not fut.done():
                fut.cancel()  # its poller job ends once the request settles or is released
            elif not fut.cancelled():
                fut.exception()  # retrieved: a request released meanwhile is read below
        return self.status(handle)
