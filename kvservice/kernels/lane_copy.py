"""The data plane's copy kernel, in Triton: one launch moves the page pairs of every segment.

The native lane (``transfer/lane/csrc/copy.cpp``) launches the cubins ``aot`` compiles from this one source
through the CUDA driver; the same function runs under ``TRITON_INTERPRET=1`` on CPU (tests) and
``reference`` below is the numpy program it must equal byte for byte. A launch's program::

    segments  [nr] x 9 uint64: src, dst, src_stride, dst_stride, nbytes, run, src_run, dst_run, pairs
              (a region of one receiver rank; grouped by target, ``per_target`` segments each)
    pairs     int32 (src_page, dst_page) pairs: target t's ``moved`` pairs start at t x moved

    grid      x = page pair (< moved), y = segment (< nr), z = chunk of ``chunk`` bytes of the page

    byte i of a page's segment (i < nbytes), run >= nbytes (whole pages):
        dst + dp*dst_stride + i  <-  src + sp*src_stride + i
    runs (a head slice, token-major pages): k = i // run, w = i % run
        dst + dp*dst_stride + k*dst_run + w  <-  src + sp*src_stride + k*src_run + w

Bytes move as 16-byte words (four int32 lanes) when every address, stride and length of the
launch is a multiple of 16 (``VEC``), else one byte at a time.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

__all__ = ["SEG_FIELDS", "lane_copy", "reference"]

SEG_FIELDS = ("src", "dst", "src_stride", "dst_stride", "nbytes", "run", "src_run", "dst_run", "pairs")
_NF: tl.constexpr = tl.constexpr(len(SEG_FIELDS))


@triton.jit
def lane_copy(
    segs_ptr,  # *uint64 [nr, 9]: the segments (SEG_FIELDS)
    pairs_ptr,  # *int32 [targets * moved, 2]: (source page, destination page)
    chunk,  # bytes of a page's segment one program moves (grid z)
    per_target,  # segments per target
    moved,  # page pairs per target (grid x)
    VEC: tl.constexpr,  # 1: 16-byte words (int32 x 4); 0: bytes
    BLOCK: tl.constexpr,  # words a program moves per step (a power of two)
):
    x = tl.program_id(0).to(tl.int64)
    y = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2).to(tl.int64)
    seg = segs_ptr + y * _NF
    nbytes = tl.load(seg + 4).to(tl.int64)
    start = z * chunk
    if start < nbytes:
        src = tl.load(seg + 0).to(tl.int64)
        dst = tl.load(seg + 1).to(tl.int64)
        src_stride = tl.load(seg + 2).to(tl.int64)
        dst_stride = tl.load(seg + 3).to(tl.int64)
        run = tl.load(seg + 5).to(tl.int64)
        src_run = tl.load(seg + 6).to(tl.int64)
        dst_run = tl.load(seg + 7).to(tl.int64)
        pair = pairs_ptr + ((y // per_target) * moved + x) * 2
        sp = tl.load(pair).to(tl.int64)
        dp = tl.load(pair + 1).to(tl.int64)
        n = tl.minimum(nbytes - start, chunk)
        WB: tl.constexpr = 16 if VEC else 1  # bytes a word
        LANES: tl.constexpr = 4 if VEC else 1  # int32 lanes a word
        if VEC:
            s_page = (src + sp * src_stride).to(tl.pointer_type(tl.int32))
            d_page = (dst + dp * dst_stride).to(tl.pointer_type(tl.int32))
        else:
            s_page = (src + sp * src_stride).to(tl.pointer_type(tl.uint8))
            d_page = (dst + dp * dst_stride).to(tl.pointer_type(tl.uint8))
        # NOTE: word numbers within a page's segment in 32 bits (a segment is < 64 GiB): a run's
        # division is then a 32-bit one, not the GPU's slow 64-bit emulation (docs/decisions/0026)
        w0 = (start // WB).to(tl.uint32)  # first word of this program
        nw = (n // WB).to(tl.uint32)
        j = tl.arange(0, BLOCK).to(tl.uint32)
        lane = tl.arange(0, LANES)
        whole = run >= nbytes
        run_w = (run // WB).to(tl.uint32)
        src_run_w = src_run // WB
        dst_run_w = dst_run // WB
        for step in range(0, nw, BLOCK):
            i = w0 + step + j  # words of the page's segment
            mask = (step + j) < nw
            if whole:
                s_w = i.to(tl.int64)
                d_w = s_w
            else:
                k = i // run_w
                w = (i - k * run_w).to(tl.int64)
                s_w = k.to(tl.int64) * src_run_w + w
                d_w = k.to(tl.int64) * dst_run_w + w
            s_ptrs = s_page + (s_w[:, None] * LANES + lane[None, :])
            d_ptrs = d_page + (d_w[:, None] * LANES + lane[None, :])
            if VEC:
                # NOTE: the table hides the bases' alignment from the compiler: say it, so a
                # word moves as one 16-byte load and store (the host checked every address).
                s_ptrs = tl.max_contiguous(tl.multiple_of(s_ptrs, [16, 16]), [1, LANES])
                d_ptrs = tl.max_contiguous(tl.multiple_of(d_ptrs, [16, 16]), [1, LANES])
            m2 = mask[:, None] & (lane[None, :] < LANES)
            tl.store(d_ptrs, tl.load(s_ptrs, mask=m2), mask=m2)


def reference(segs: np.ndarray, pairs: np.ndarray, moved: int, memory: dict[int, np.ndarray]) -> None:
    """The program in numpy, on host buffers: ``memory`` maps each buffer's base address (the
    segments' ``src``/``dst`` point into them) to the buffer as uint8; writes the destinations."""

    def view(addr: int) -> tuple[np.ndarray, int]:
        for base, buf in memory.items():
            if base <= addr < base + buf.size:
                return buf, addr - base
        raise ValueError(f"address {addr:#x} is in no buffer")

    segs = np.asarray(segs, dtype=np.uint64).reshape(-1, len(SEG_FIELDS))
    per_target = len(segs) // (int(segs[-1, 8]) // moved + 1)
    pr = np.asarray(pairs, dtype=np.int32).reshape(-1, 2)
    for y, s in enumerate(segs.astype(np.int64)):  # (a reference: clear over fast)
        src, dst, ss, ds, nbytes, run, s_run, d_run, _ = (int(v) for v in s)
        i = np.arange(nbytes)
        k, w = (i // run, i % run) if run < nbytes else (np.zeros_like(i), i)
        for sp, dp in pr[(y // per_target) * moved : (y // per_target + 1) * moved]:
            sb, so = view(src + int(sp) * ss)
            db, do = view(dst + int(dp) * ds)
            db[do + k * d_run + w] = sb[so + k * s_run + w]
