"""The fault guard: an engine shrinking or dropping memory it registered fails its transfers,
never the service.

An engine owns its shared-memory segments and may ``ftruncate`` one at any time. Touching a page
of the service's mapping past the segment's new end raises SIGBUS, which would kill the service
and every engine's transfers with it. ``csrc/guard.cpp`` installs a SIGBUS handler that repairs
such a fault (anonymous pages mapped over the lost part of that mapping, the range marked
faulted) and lets the access finish; every route checks its pools here after its copies and ends
the transfer FAILED naming the buffer set (:func:`lost`). A fault outside every guarded mapping
goes to the handler installed before ours (the process dies as it would have).

Why a repairing handler rather than sealed memfd pools: it covers every thread that may touch
engine memory (the lane's memcpy, torch and numpy copies, UCX reading a source page) with no
change to how engines share memory, and costs one atomic load per check while nothing faulted.
Sealing (F_SEAL_SHRINK) would need every engine to pass a memfd over the socket.

Built once (C++ through torch's extension builder, no Python API: loaded with ctypes) into
``$KVSERVICE_NATIVE_DIR/guard-<tag>/`` when prebuilt there (the image), else the JIT cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = ["Guard", "GuardUnavailable", "get", "lost"]

log = logging.getLogger(__name__)
_SRC = Path(__file__).with_name("csrc") / "guard.cpp"
_NAME = "kvservice_guard"
_lock = threading.Lock()
_guard: Guard | None = None
_failed = ""


class GuardUnavailable(RuntimeError):
    """The guard cannot be built or loaded here (no C++ compiler)."""


class Guard:
    """The loaded library: guarded ranges of this process's mappings of engine memory."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.kvg_install.restype = ctypes.c_int
        lib.kvg_add.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        lib.kvg_add.restype = ctypes.c_int
        lib.kvg_remove.argtypes = [ctypes.c_int]
        lib.kvg_faulted.argtypes = [ctypes.c_int]
        lib.kvg_faulted.restype = ctypes.c_int
        lib.kvg_faults.restype = ctypes.c_uint64
        lib.kvg_range_faulted.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        lib.kvg_range_faulted.restype = ctypes.c_int
        if lib.kvg_install() != 0:
            raise GuardUnavailable("sigaction(SIGBUS) failed")

    def add(self, base: int, size: int) -> int:
        """Guard ``[base, base + size)``; its slot (-1: the table is full, logged)."""
        self._lib.kvg_install()  # in front again if a handler was installed after ours
        slot = int(self._lib.kvg_add(base, size))
        if slot < 0:
            log.error("fault guard full: a mapping is not guarded", extra={"bytes": size})
        return slot

    def remove(self, slot: int) -> None:
        self._lib.kvg_remove(slot)

    def faulted(self, slot: int) -> bool:
        return bool(self._lib.kvg_faulted(slot))

    @property
    def faults(self) -> int:
        """Faults repaired since the service started."""
        return int(self._lib.kvg_faults())

    def range_faulted(self, base: int, size: int) -> bool:
        return bool(self._lib.kvg_range_faulted(base, size))

    def addresses(self) -> tuple[int, int]:
        """(kvg_faults, kvg_range_faulted) as C function addresses, for native code (the lane)."""
        return (
            ctypes.cast(self._lib.kvg_faults, ctypes.c_void_p).value or 0,
            ctypes.cast(self._lib.kvg_range_faulted, ctypes.c_void_p).value or 0,
        )


def _tag() -> str:
    h = hashlib.sha256(_SRC.read_bytes())
    h.update(sys.implementation.cache_tag.encode())
    return h.hexdigest()[:16]


def _library(directory: Path) -> Path | None:
    return next(iter(sorted(directory.glob(f"{_NAME}*.so"))), None) if directory.is_dir() else None


def _build() -> Path:
    from kvservice_client.jit_cache import cache_root

    tag = "guard-" + _tag()
    pre = os.environ.get("KVSERVICE_NATIVE_DIR")
    if pre and (lib := _library(Path(pre) / tag)) is not None:
        return lib
    if pre and os.access(pre, os.W_OK):
        out = Path(pre) / tag
    else:
        root = cache_root()
        if root is None:
            raise GuardUnavailable("no writable cache directory (set KVSERVICE_CACHE_DIR)")
        out = root / "native" / tag
    if (lib := _library(out)) is not None:
        return lib
    try:
        from ..native_build import compile_extension

        compile_extension(_NAME, [_SRC], out, is_python_module=False)
    except Exception as exc:  # no compiler, no ninja, no dir: say which
        raise GuardUnavailable(f"building the fault guard failed: {type(exc).__name__}: {exc}") from exc
    lib = _library(out)
    if lib is None:
        raise GuardUnavailable(f"the fault guard was built but {out} holds no {_NAME}*.so")
    return lib


def get() -> Guard | None:
    """The guard, built and installed on first use (thread-safe); None, logged once, when it
    cannot be built here (engine memory then is not fault-safe)."""
    global _guard, _failed
    with _lock:
        if _guard is None and not _failed:
            try:
                _guard = Guard(ctypes.CDLL(str(_build())))
            except (GuardUnavailable, OSError) as exc:
                _failed = str(exc)
                log.error(
                    "fault guard off: an engine shrinking its shared memory can kill this service",
                    extra={"reason": _failed},
                )
        return _guard


def lost(buffer_set_id: str, slots: Iterable[int]) -> str:
    """Why buffer set ``buffer_set_id`` (its mappings' guard ``slots``, iterated only once a
    fault happened) cannot take part in a transfer any more, or '' while its memory is whole."""
    g = _guard
    if g is None or not g.faults or not any(g.faulted(s) for s in slots if s >= 0):
        return ""
    return (
        f"buffer set {buffer_set_id!r}: its shared memory shrank under the service (the engine "
        "truncated or dropped it); its transfers fail: unregister it and register new memory"
    )


def main() -> None:
    """Build ahead of the first service start (setup, the image): ``python -c 'import
    kvservice.buffers.guard as g; g.main()'`` (``-m`` would import this module twice)."""
    logging.basicConfig(level=logging.INFO)
    try:
        print(f"fault guard: {_build()}")
    except GuardUnavailable as exc:
        print(f"fault guard unavailable: {exc}", file=sys.stderr)
        sys.exit(1)
