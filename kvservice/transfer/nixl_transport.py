"""NIXL implementation of :class:`Transport` — the only module that imports ``nixl``.

What works on a CPU-only host (measured here, NIXL 1.5.1 nixl-cu13 wheel, bundled UCX, root,
2 cores, no GPU), two agents in two spawned processes, DRAM from numpy buffers:

``UCX_TLS`` and the result:

- unset (default): works. RMA puts over ``cma/memory``, active messages and notifications over
  ``tcp/lo`` (seen with ``UCX_PROTO_INFO=y``).
- ``cma,tcp`` or ``sm,tcp``: works, same protocols as the default.
- ``tcp``: works, puts over tcp (lo + eth0), about 2x slower than cma.
- ``shm``, ``cma``, ``posix``, ``sysv``, ``self`` or ``shm,self`` (anything without tcp):
  ``createBackend`` fails with NIXL_ERR_BACKEND. NIXL's UCX endpoints need peer-failure handling
  and an active-message lane; UCX says "no active messages transport: sysv/memory - no peer
  failure handler, posix/memory - no peer failure handler, cma/memory - no am bcopy".
- ``UCX_TLS=""`` (set but empty): fails, "The TLs list is empty"; unset it instead.

Behaviour worth knowing (all seen here):

- ``add_remote_agent`` returns the name as ``bytes``; ``get_new_notifs`` keys are ``str``. We
  return and key by ``str`` everywhere.
- With cma the post completes inside ``transfer()`` (it returns ``DONE``, blocking the caller for
  the whole copy); with tcp it returns ``PROC``. Call ``write`` off the event loop.
- Releasing a ``PROC`` handle returned without error and the bytes still landed: it is no cancel
  (see ``transport.py`` for how aborts are settled instead).
- Strided (N, 5) prepped lists need ``mem_type``; their elements are indexed row-major.
- Telemetry is off unless the agent is created with it; we do not use it.

Measured with ``bench/bench_transport.py`` (two processes, 8,192 x 32 KiB = 256 MiB, median;
this 2-core box is noisy; these figures predate the progress delay below, when both agents'
progress threads spun):

- 1 descriptor: 54-108 ms (2.5-4.9 GB/s) with cma; 223 ms (1.2 GB/s) with tcp.
- 8,192 scattered descriptors: 114-214 ms (1.2-2.3 GB/s) with cma; 432 ms (0.6 GB/s) with tcp.
- 8,192 descriptors contiguous on both sides: as fast as 1 descriptor (NIXL merges them).
- Per-descriptor overhead: 8-13 us with cma, 25 us with tcp.

With 1 KiB pages (8 MiB): 1 descriptor 1.5 ms, 8,192 scattered 67 ms (0.13 GB/s), a torch
gather of the same bytes 1 ms: tiny descriptors must be packed even on CPU.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..errors import KVServiceError, NotFound, TransportError
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

try:
    from nixl import _api as _nixl_api
    from nixl import _bindings as _nixl_bindings
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    NIXL_IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a broken wheel raising at import
    NIXL_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PROGRESS_DELAY_US",
    "NIXL_ERRORS",
    "NIXL_IMPORT_ERROR",
    "NixlTransport",
    "nixl_available",
    "nixl_error_classes",
    "translate_nixl_error",
]

# Every exception class of nixl._bindings → what it means for us (test_transport_errors checks
# that no class is left out).
NIXL_ERRORS: dict[str, str] = {
    "nixlBackendError": "backend (UCX) failure",
    "nixlCancelledError": "transfer cancelled",
    "nixlInvalidParamError": "invalid parameter",
    "nixlMismatchError": "descriptor or memory type mismatch",
    "nixlNoTelemetryError": "telemetry not enabled",
    "nixlNotAllowedError": "operation not allowed in this state",
    "nixlNotFoundError": "unknown agent, memory or descriptor",
    "nixlNotPostedError": "transfer not posted",
    "nixlNotSupportedError": "not supported by the backend",
    "nixlRemoteDisconnectError": "remote agent disconnected",
    "nixlRepostActiveError": "transfer still active, cannot repost",
    "nixlUnknownError": "unknown NIXL error",
}


def nixl_available() -> bool:
    """True when ``nixl`` imported; ``NIXL_IMPORT_ERROR`` says why not otherwise."""
    return NIXL_IMPORT_ERROR is None


def nixl_error_classes() -> list[str]:
    """Names of the exception classes ``nixl._bindings`` defines (empty without nixl)."""
    if NIXL_IMPORT_ERROR is not None:
        return []
    return sorted(n for n in dir(_nixl_bindings) if n.startswith("nixl") and n.endswith("Error"))


def translate_nixl_error(op: str, exc: BaseException) -> TransportError:
    """Map any exception raised by NIXL (or its Python wrapper) to TransportError."""
    name = type(exc).__name__
    reason = NIXL_ERRORS.get(name, "unexpected error")
    return TransportError(f"{op}: {reason} ({name}: {exc})")


DEFAULT_PROGRESS_DELAY_US = 1000
_agent_lock = threading.Lock()


class _Bindings:
    """nixl's bindings module (``inner``) seen through one change: the agent config the wrapper
    builds gets our progress-thread delay (``made`` counts the configs built). Every other name
    is ``inner``'s."""

    def __init__(self, delay_us: int, inner: Any) -> None:
        self._inner = inner
        base = inner.nixlAgentConfig
        self.made = 0
        outer = self

        class Config(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                outer.made += 1
                base.pthrDelay.__set__(self, delay_us)

            @property
            def pthrDelay(self) -> int:  # noqa: N802 - the binding's name
                return int(base.pthrDelay.__get__(self))

            @pthrDelay.setter
            def pthrDelay(self, value: int) -> None:  # noqa: N802
                base.pthrDelay.__set__(self, delay_us)

        self.nixlAgentConfig = Config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _create_agent(name: str, conf: Any, progress_delay_us: int) -> Any:
    """``nixl_agent(name, conf)`` with the progress thread's delay set to ``progress_delay_us``.

    NOTE: nixl's Python wrapper (1.5) hard-codes ``pthrDelay = 0``, and UCX's progress thread then
    polls without sleeping (~7,000 epoll/poll/read rounds a second): a whole core per service,
    idle or not. On the 2-core VM that halved the same-node copy and doubled the one-page
    transfer (bench_transfer / bench_control at 0 vs 1000 us, docs/operations.md). The C++
    config has the knob; the wrapper builds that config through its module's ``nixlBind``,
    which we swap for the one construction (under a lock, restored at once).
    """
    if progress_delay_us == 0:
        return nixl_agent(name, conf)
    with _agent_lock:
        real = _nixl_api.nixlBind
        bind = _Bindings(progress_delay_us, real)
        _nixl_api.nixlBind = bind
        try:
            agent = nixl_agent(name, conf)
        finally:
            _nixl_api.nixlBind = real
    if not bind.made:
        log.warning(
            "nixl did not build its agent config through nixl._api.nixlBind: progress delay %d us "
            "not applied, its progress thread may spin a core",
            progress_delay_us,
        )
    return agent


@contextmanager
def _nixl(op: str) -> Iterator[None]:
    try:
        yield
    except KVServiceError:
        raise
    except Exception as exc:
        raise translate_nixl_error(op, exc) from exc


class NixlTransport(Transport):
    """One NIXL agent with the UCX backend. Thread-safe: the agent runs in STRICT sync mode and
    our tables are guarded by a lock."""

    kind = "nixl"

    def __init__(
        self,
        name: str,
        backends: tuple[str, ...] = ("UCX",),
        num_threads: int = 0,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    ) -> None:
        if NIXL_IMPORT_ERROR is not None:
            raise TransportError(f"nixl is not available: {NIXL_IMPORT_ERROR}")
        conf = nixl_agent_config(
            enable_prog_thread=True,
            backends=list(backends),
            num_threads=num_threads,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        with _nixl("create agent"):
            self._agent = _create_agent(name, conf, progress_delay_us)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransportError(f"create agent: backend(s) {missing} not available")
        self._name = name
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._regs: dict[int, Any] = {}
        self._lists: dict[int, tuple[Any, ListGeometry]] = {}
        self._xfers: dict[int, Any] = {}
        self._peers: set[str] = set()

    @property
    def agent_name(self) -> str:
        return self._name

    def metadata(self) -> bytes:
        with _nixl("metadata"):
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, name: str, metadata: bytes) -> str:
        with self._lock:
            if name in self._peers:
                with _nixl("add_peer"):
                    self._agent.remove_remote_agent(name)
                self._peers.discard(name)
            with _nixl("add_peer"):
                got = self._agent.add_remote_agent(metadata)
            got_str = got.decode() if isinstance(got, bytes) else str(got)
            if got_str != name:
                with _nixl("add_peer"):
                    self._agent.remove_remote_agent(got_str)
                raise TransportError(f"add_peer: metadata is of agent {got_str!r}, expected {name!r}")
            self._peers.add(name)
            return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if name not in self._peers:
                return
            self._peers.discard(name)
            with _nixl("remove_peer"):
                self._agent.remove_remote_agent(name)

    def register(self, addr: int, size: int, mem_kind: MemKind, device_id: int) -> RegHandle:
        with _nixl("register"):
            descs = self._agent.register_memory([(addr, size, device_id, "")], mem_kind)
        with self._lock:
            handle = RegHandle(next(self._ids), addr, size, mem_kind, device_id)
            self._regs[handle.id] = descs
        return handle

    def deregister(self, handle: RegHandle) -> None:
        with self._lock:
            descs = self._regs.pop(handle.id, None)
        if descs is None:
            raise NotFound(f"registration {handle.id} is not known")
        with _nixl("deregister"):
            self._agent.deregister_memory(descs)

    def _prep(self, agent: str, regions: np.ndarray, mem_kind: MemKind) -> tuple[int, int]:
        geo = ListGeometry.of(regions)
        with _nixl("prep"):
            # NOTE: always pass the (N, 5) form: one code path, and NIXL merges runs itself.
            dlist = self._agent.prep_xfer_dlist(agent, geo.rows, mem_kind)
        with self._lock:
            lid = next(self._ids)
            self._lists[lid] = (dlist, geo)
        return lid, geo.count

    def prep_local(self, regions: np.ndarray, mem_kind: MemKind = "DRAM") -> LocalDescList:
        lid, count = self._prep("NIXL_INIT_AGENT", regions, mem_kind)
        return LocalDescList(lid, mem_kind, count)

    def prep_remote(self, peer: str, regions: np.ndarray, mem_kind: MemKind = "DRAM") -> RemoteDescList:
        if peer not in self._peers:
            raise NotFound(f"peer {peer!r} is not known")
        lid, count = self._prep(peer, regions, mem_kind)
        return RemoteDescList(lid, peer, mem_kind, count)

    def release_list(self, dlist: LocalDescList | RemoteDescList) -> None:
        with self._lock:
            entry = self._lists.pop(dlist.id, None)
        if entry is not None:
            with _nixl("release_list"):
                entry[0].release()

    def _list(self, dlist: LocalDescList | RemoteDescList) -> tuple[Any, ListGeometry]:
        with self._lock:
            entry = self._lists.get(dlist.id)
        if entry is None:
            raise NotFound(f"descriptor list {dlist.id} is not known")
        return entry

    def _post(self, op: str, peer: str, descriptors: int, nbytes: int, make: Any) -> XferHandle:
        with _nixl(op):
            xfer = make()
            state = self._agent.transfer(xfer)
        if state == "ERR":
            with _nixl(op):
                xfer.release()
            raise TransportError(f"{op}: posting the transfer to {peer!r} failed")
        with self._lock:
            handle = XferHandle(next(self._ids), peer, descriptors, nbytes)
            self._xfers[handle.id] = xfer
        return handle

    def write(
        self,
        local: LocalDescList,
        local_idx: np.ndarray,
        remote: RemoteDescList,
        remote_idx: np.ndarray,
        notif: bytes | None = None,
    ) -> XferHandle:
        ldl, lgeo = self._list(local)
        rdl, rgeo = self._list(remote)
        li, ri, nbytes = check_write(lgeo, local_idx, rgeo, remote_idx)
        return self._post(
            "write",
            remote.peer,
            int(li.size),
            nbytes,
            lambda: self._agent.make_prepped_xfer("WRITE", ldl, li, rdl, ri, notif or b""),
        )

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
        idx = np.arange(lgeo.count, dtype=np.int32)
        _, _, nbytes = check_write(lgeo, idx, rgeo, np.arange(rgeo.count, dtype=np.int32))
        if peer not in self._peers:
            raise NotFound(f"peer {peer!r} is not known")
        ld, rd = lgeo.select(idx.astype(np.int64)), rgeo.select(idx.astype(np.int64))

        def make() -> Any:
            a = self._agent
            return a.initialize_xfer(
                "WRITE",
                a.get_xfer_descs(ld, mem_kind),
                a.get_xfer_descs(rd, remote_mem_kind),
                peer,
                notif or b"",
            )

        return self._post("write_descs", peer, int(idx.size), nbytes, make)

    def status(self, handle: XferHandle) -> XferState:
        # NOTE: under the lock: a poller thread (completions.polled) checks handles while the loop
        # may release one; a released request is never checked.
        with self._lock:
            xfer = self._xfers.get(handle.id)
            if xfer is None:
                raise NotFound(f"transfer handle {handle.id} is not known")
            with _nixl("status"):
                state = self._agent.check_xfer_state(xfer)
        return "DONE" if state == "DONE" else "PROC" if state == "PROC" else "ERR"

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            xfer = self._xfers.pop(handle.id, None)
            if xfer is None:
                return
            with _nixl("release"):
                xfer.release()

    def notifications(self) -> dict[str, list[bytes]]:
        with _nixl("notifications"):
            raw = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in raw.items()}

    def send_notif(self, peer: str, message: bytes) -> None:
        if peer not in self._peers:
            raise NotFound(f"peer {peer!r} is not known")
        with _nixl("send_notif"):
            self._agent.send_notif(peer, message)

    def close(self) -> None:
        with self._lock:
            xfers, self._xfers = list(self._xfers.values()), {}
            lists, self._lists = list(self._lists.values()), {}
            regs, self._regs = list(self._regs.values()), {}
            peers, self._peers = list(self._peers), set()
        # Best effort: a failing release must not keep the rest from being freed.
        for release in [x.release for x in xfers] + [entry[0].release for entry in lists]:
            try:
                release()
            except Exception:
                pass
        for descs in regs:
            try:
                self._agent.deregister_memory(descs)
            except Exception:
                pass
        for peer in peers:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:
                pass
        # The agent goes now, with UCX's threads and NIXL's progress thread: left to the garbage
        # collector (the service's objects form cycles) a stopped service kept polling.
        self._agent = None  # type: ignore[assignment]  # a later call fails translated (_nixl)
