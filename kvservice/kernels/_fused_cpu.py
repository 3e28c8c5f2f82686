"""The CPU fused copy: one compiled loop over the page table, source pages straight into destination pages.

Regions are reached through their base addresses (an int64 table per side), so one call covers
every layer's K and V; no temporary gather buffer and no Python loop per page or per region.
A call moves units (``_regions``: ``m`` units a page) as ``outer x inner`` runs (``Loops``)::

    for r in regions, i in units:                 (units split over threads when there are many)
        src unit = src_base[r] + (su // m_src)*src_page + (su % m_src)*src_unit + src_head_off
        dst unit = dst_base[r] + (du // m_dst)*dst_page + (du % m_dst)*dst_unit + dst_head_off
        copy ``row`` bytes at  unit + a*outer + b*inner   for a < outer_count, b < inner_count

A run is a whole unit when both sides hold it in one piece, else a token row, a head's tokens or
one head row (``copy_loops``). On x86 a
16-byte aligned run is copied with non-temporal (streaming) stores, then ``sfence``; other runs
use LLVM's memcpy. ``parallel`` spreads the (region, page) jobs over numba's threads. Both builds
are cached on disk (``jit_cache``), so only the first process on a machine compiles them.
"""

from __future__ import annotations

import platform
import threading
import types as pytypes
from typing import Any

import numpy as np
from kvservice_client.jit_cache import njit
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["copy_regions", "ready", "warm"]

PARALLEL_BYTES = 4 << 20  # smaller copies run on the calling thread alone
JOBS_PER_FENCE = 16  # (region, unit) jobs between two store fences; a block is one parallel task
_X86 = platform.machine().lower() in ("x86_64", "amd64")
_run_lock = threading.Lock()
_warmed = False


@intrinsic
def stream(typingctx: Any, dst: Any, src: Any, nbytes: Any) -> Any:  # pragma: no cover - compiled
    """Copy 16-byte aligned ``nbytes`` (a multiple of 16) with non-temporal stores."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, s, n = args
        vp = ir.VectorType(ir.IntType(64), 2).as_pointer()
        dp, sp = builder.inttoptr(d, vp), builder.inttoptr(s, vp)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, builder.udiv(n, ir.Constant(ir.IntType(64), 16))) as loop:
            v = builder.load(builder.gep(sp, [loop.index]), align=16)
            store = builder.store(v, builder.gep(dp, [loop.index]), align=16)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def plain(typingctx: Any, dst: Any, src: Any, nbytes: Any) -> Any:  # pragma: no cover - compiled
    """LLVM's memcpy of ``nbytes`` bytes (any alignment)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, s, n = args
        cgutils.raw_memcpy(
            builder, builder.inttoptr(d, cgutils.voidptr_t), builder.inttoptr(s, cgutils.voidptr_t), n, 1
        )
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def fence(typingctx: Any) -> Any:  # pragma: no cover - compiled
    """Order the non-temporal stores before whatever follows (x86 ``sfence``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fn = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(inline="always")
def run(d: int, s: int, nbytes: int) -> None:  # pragma: no cover - compiled
    # NOTE: streaming stores skip the read-for-ownership of destination lines: ~1.5x on
    # scattered 4 KiB pages (bench_transfer --same-node); the engine reads the pages later.
    if _X86 and ((d | s | nbytes) & 15) == 0:
        stream(d, s, nbytes)  # type: ignore[call-arg]
    else:
        plain(d, s, nbytes)  # type: ignore[call-arg]


def body(
    src_base: np.ndarray,  # int64 [R] region base addresses
    dst_base: np.ndarray,
    src_units: np.ndarray,  # int64 [n]
    dst_units: np.ndarray,
    geom: np.ndarray,  # int64 [R, 10] bytes, per side: page, unit, outer, inner, head offset
    dims: np.ndarray,  # int64 [R, 3]: outer count, inner count, run bytes
    m_src: int,  # units per page
    m_dst: int,
) -> None:  # pragma: no cover - compiled
    n = src_units.size
    total = src_base.size * n
    # NOTE: jobs go in blocks of JOBS_PER_FENCE, one sfence a block: with small units (a token of
    # a page-1 pool) a fence per job cost more than the copy (bench_convert).
    for blk in prange((total + JOBS_PER_FENCE - 1) // JOBS_PER_FENCE):
        for job in range(blk * JOBS_PER_FENCE, min(total, (blk + 1) * JOBS_PER_FENCE)):
            r = job // n
            i = job % n
            su, du = src_units[i], dst_units[i]
            s0 = src_base[r] + (su // m_src) * geom[r, 0] + (su % m_src) * geom[r, 1] + geom[r, 4]
            d0 = dst_base[r] + (du // m_dst) * geom[r, 5] + (du % m_dst) * geom[r, 6] + geom[r, 9]
            so, si, do, di, row = geom[r, 2], geom[r, 3], geom[r, 7], geom[r, 8], dims[r, 2]
            for a in range(dims[r, 0]):
                for b in range(dims[r, 1]):
                    run(d0 + a * do + b * di, s0 + a * so + b * si, row)
        if _X86:
            fence()  # type: ignore[call-arg]


# NOTE: small copies take the serial build: waking the parallel build's thread team costs more
# than they do, and its threads then spin, taking the CPU from the event loop on small hosts.
# NOTE: numba's disk cache keys a function by its name and line, not by its flags: the parallel
# build gets a copy of ``body`` under its own name, or it would load the serial build from cache.
_serial = njit(nogil=True)(body)
_body_parallel = pytypes.FunctionType(
    body.__code__.replace(co_name="body_parallel"), globals(), "body_parallel"
)
_body_parallel.__qualname__ = "body_parallel"
_parallel = njit(nogil=True, parallel=True)(_body_parallel)


def _compiled() -> tuple[Any, Any]:
    return _serial, _parallel


def ready() -> bool:
    """Whether ``warm`` compiled (or loaded) both builds: calls will not wait for the JIT."""
    return _warmed


def copy_regions(
    src_base: np.ndarray,
    dst_base: np.ndarray,
    src_units: np.ndarray,
    dst_units: np.ndarray,
    geom: np.ndarray,
    dims: np.ndarray,
    m_src: int = 1,
    m_dst: int = 1,
) -> None:
    """Copy (byte geometry, checked by the caller: every address lies in a mapped region).

    Parallel calls are serialised: each one already uses every numba thread, and numba's fallback
    threading layer ("workqueue", when neither TBB nor OpenMP loads) aborts the process on
    concurrent parallel calls from two threads.
    """
    serial, parallel = _compiled()
    args = (src_base, dst_base, src_units, dst_units, geom, dims, m_src, m_dst)
    if src_units.size * int((dims[:, 0] * dims[:, 1] * dims[:, 2]).sum()) <= PARALLEL_BYTES:
        serial(*args)
        return
    with _run_lock:
        parallel(*args)


def warm() -> None:
    """Compile (or load from the disk cache) both builds now, on scratch buffers."""
    global _warmed
    a, b = np.ones(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    one = np.zeros(1, dtype=np.int64)
    args = (
        np.array([a.ctypes.data], dtype=np.int64),
        np.array([b.ctypes.data], dtype=np.int64),
        one,
        one,
        np.array([[64, 32, 16, 0, 0, 64, 32, 16, 0, 0]], dtype=np.int64),
        np.array([[2, 1, 16]], dtype=np.int64),
        2,
        2,
    )
    for build in _compiled():
        build(*args)
    _warmed = True
