"""An experiment beside the lane's copy kernel (bench/sweep_lane_kernel.py): head-slice runs copied
as a tile of (run, word of the run) rows, so no word divides by the run length.

``kernels/lane_copy.py`` numbers a page's words end to end and finds each word's run with a 32-bit
division (``k = i // run_w``). Here a program divides once (its first run) and moves tiles of
``BLOCK // CW`` runs x ``CW`` words (CW a power of two: shifts); a run longer than CW words takes
several column steps, a shorter one masks the rest of its row. Same arguments and segment table as
``lane_copy``, 16-byte words only, runs only (``run < nbytes``): the sweep's slice rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

_NF: tl.constexpr = tl.constexpr(9)


@triton.jit
def lane_copy_runs2d(
    segs_ptr,
    pairs_ptr,
    chunk,
    per_target,
    moved,
    VEC: tl.constexpr,  # 1 only
    BLOCK: tl.constexpr,  # words a program moves per step
):
    CW: tl.constexpr = 8  # words of a run a tile row holds (128 bytes)
    ROWS: tl.constexpr = BLOCK // CW
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
        src_run_w = tl.load(seg + 6).to(tl.int64) // 16
        dst_run_w = tl.load(seg + 7).to(tl.int64) // 16
        pair = pairs_ptr + ((y // per_target) * moved + x) * 2
        sp = tl.load(pair).to(tl.int64)
        dp = tl.load(pair + 1).to(tl.int64)
        n = tl.minimum(nbytes - start, chunk)
        s_page = (src + sp * src_stride).to(tl.pointer_type(tl.int32))
        d_page = (dst + dp * dst_stride).to(tl.pointer_type(tl.int32))
        w0 = (start // 16).to(tl.int32)
        w1 = w0 + (n // 16).to(tl.int32)
        run_w = (run // 16).to(tl.int32)
        k0 = w0 // run_w
        k1 = (w1 - 1) // run_w + 1
        j = tl.arange(0, BLOCK)
        r = j // CW
        c = j % CW
        lane = tl.arange(0, 4)
        for kb in range(k0, k1, ROWS):
            k = kb + r
            for cb in range(0, run_w, CW):
                w = cb + c
                i = k * run_w + w
                mask = (w < run_w) & (i >= w0) & (i < w1)
                s_w = k.to(tl.int64) * src_run_w + w
                d_w = k.to(tl.int64) * dst_run_w + w
                s_ptrs = s_page + (s_w[:, None] * 4 + lane[None, :])
                d_ptrs = d_page + (d_w[:, None] * 4 + lane[None, :])
                s_ptrs = tl.max_contiguous(tl.multiple_of(s_ptrs, [16, 16]), [1, 4])
                d_ptrs = tl.max_contiguous(tl.multiple_of(d_ptrs, [16, 16]), [1, 4])
                m2 = mask[:, None] & (lane[None, :] < 4)
                tl.store(d_ptrs, tl.load(s_ptrs, mask=m2), mask=m2)
