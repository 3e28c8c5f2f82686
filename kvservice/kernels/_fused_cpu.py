"""The CPU fused copy: one compiled loop over the page table, source pages straight into destination pages.

Regions are reached through their base addresses (an int64 table per side), so one call covers
every layer's K and V; no temporary gather buffer and no Python loop per page or per region::

    for r in regions, i in pages:                 (pages split over threads when there are many)
        src row  = src_base[r] + src_pages[i]*src_page + t*src_token + src_head_off
        dst row  = dst_base[r] + dst_pages[i]*dst_page + t*dst_token + dst_head_off
        copy ``row`` bytes for each token t        (one copy of the whole page when rows are whole)

Each run is one libc ``memcpy`` (a whole page when the copied rows are whole token rows, else one
token row); ``parallel`` spreads the (region, page) jobs over numba's threads.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["copy_regions", "warm"]

_lock = threading.Lock()
_run_lock = threading.Lock()

_impl: Any = None


def _build() -> Any:
    import ctypes
    import ctypes.util

    import numba
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    memcpy = libc.memcpy
    memcpy.restype = ctypes.c_void_p
    memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

    def as_ptr_typer(typingctx: Any, addr: Any) -> Any:  # pragma: no cover - compiled
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], cgutils.voidptr_t)

        return types.voidptr(types.int64), codegen

    as_ptr: Any = intrinsic(as_ptr_typer)

    # NOTE: not cached on disk: numba cannot pickle the ctypes memcpy it calls (~1-2 s to compile,
    # paid once per process, in the background when the transfer engine starts: ``warm``).
    @numba.njit(nogil=True, parallel=True)
    def copy(  # pragma: no cover - compiled
        src_base: np.ndarray,  # int64 [R] region base addresses
        dst_base: np.ndarray,
        src_pages: np.ndarray,  # int64 [n]
        dst_pages: np.ndarray,
        geom: np.ndarray,  # int64 [R, 6] bytes: src_page, src_token, src_off, dst_page, dst_token, dst_off
        rows: np.ndarray,  # int64 [R] bytes of a token row copied
        page_size: int,
    ) -> None:
        n = src_pages.size
        for job in numba.prange(src_base.size * n):
            r = job // n
            i = job % n
            st, dt, row = geom[r, 1], geom[r, 4], rows[r]
            s0 = src_base[r] + src_pages[i] * geom[r, 0] + geom[r, 2]
            d0 = dst_base[r] + dst_pages[i] * geom[r, 3] + geom[r, 5]
            if row == st and row == dt:  # whole token rows on both sides: the page is one run
                memcpy(as_ptr(d0), as_ptr(s0), row * page_size)
            else:
                for t in range(page_size):
                    memcpy(as_ptr(d0 + t * dt), as_ptr(s0 + t * st), row)

    return copy


def _compiled() -> Any:
    global _impl
    with _lock:
        if _impl is None:
            _impl = _build()
        return _impl


def copy_regions(
    src_base: np.ndarray,
    dst_base: np.ndarray,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    geom: np.ndarray,
    rows: np.ndarray,
    page_size: int,
) -> None:
    """Copy (byte geometry, checked by the caller: every address lies in a mapped region).

    Calls are serialised: each one already uses every numba thread, and numba's fallback
    threading layer ("workqueue", when neither TBB nor OpenMP loads) aborts the process on
    concurrent parallel calls from two threads.
    """
    fn = _compiled()
    with _run_lock:
        fn(src_base, dst_base, src_pages, dst_pages, geom, rows, page_size)


def warm() -> None:
    """Compile now (one page between two scratch buffers), so no transfer pays for it."""
    a, b = np.ones(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    one = np.zeros(1, dtype=np.int64)
    geom = np.array([[64, 16, 0, 64, 16, 0]], dtype=np.int64)
    copy_regions(
        np.array([a.ctypes.data], dtype=np.int64),
        np.array([b.ctypes.data], dtype=np.int64),
        one,
        one,
        geom,
        np.array([16], dtype=np.int64),
        4,
    )
