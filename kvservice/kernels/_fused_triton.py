"""Triton fused copy: one launch reads source pages and writes destination pages of every region.

Each program copies ``BLOCK_C`` row chunks of ``ROW_BLOCK`` words of one region; a unit is
``OUTER x INNER`` runs (``FusedArgs.kind_geometry``) and a run is ``KCH`` chunks::

    chunk c  = ((i * OUTER + a) * INNER + b) * KCH + k          i unit of the call, (a, b) run
    src word = (su // ms)*src_page + (su % ms)*src_unit + a*src_outer + b*src_inner + src_off
               + k*ROW_BLOCK + w                                su = src_units[i]; dst alike

Base addresses come from one int64 table per side, so the destination may live on a peer GPU
(the launch runs on the source device and writes through peer access) — the caller enables
peer access first. Words are the widest size (8/4/2/1 bytes) dividing every address and stride.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import triton
import triton.language as tl

from ._checks import to_device
from ._regions import KVRegions, pow2_divisor
from ._triton import _WORDS

if TYPE_CHECKING:
    from .fused import FusedArgs

__all__ = ["copy"]

_BLOCK_WORDS = 8192
_MAX_ROW_BLOCK = 64


@triton.jit
def _fused_kernel(
    src_table,  # *int64 [regions]: base byte address of each source region
    dst_table,  # *int64 [regions]: base byte address of each destination region
    src_units_ptr,  # *int64 [n]
    dst_units_ptr,  # *int64 [n]
    n_chunks,  # n * OUTER * INNER * KCH
    src_page,  # words between consecutive source pages
    src_unit,  # words between consecutive units of a source page
    src_outer,  # words between outer runs
    src_inner,  # words between inner runs
    src_off,  # words from a source unit's start to the first copied head
    dst_page,
    dst_unit,
    dst_outer,
    dst_inner,
    dst_off,
    WORD: tl.constexpr,
    SRC_M: tl.constexpr,  # units per source page (constexpr: see the NOTE in the body)
    DST_M: tl.constexpr,  # units per destination page
    OUTER: tl.constexpr,
    INNER: tl.constexpr,
    KCH: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ALIGNED: tl.constexpr,  # every run starts 16-byte aligned on both sides (checked on the host)
    EVICT: tl.constexpr,  # "" or "evict_first": the bytes are read and written once (streaming)
):
    pid = tl.program_id(0).to(tl.int64)
    region = tl.program_id(1).to(tl.int64)
    c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    w = tl.arange(0, ROW_BLOCK)
    mask_c = c < n_chunks
    mask = mask_c[:, None] & (w[None, :] < ROW_BLOCK)
    i = c // (OUTER * INNER * KCH)
    a = (c // (INNER * KCH)) % OUTER
    b = (c // KCH) % INNER
    k = c % KCH
    su = tl.load(src_units_ptr + i, mask=mask_c, other=0)
    du = tl.load(dst_units_ptr + i, mask=mask_c, other=0)
    # NOTE: with a runtime m (see _triton) on either side the divisions took this kernel from
    # 124-128 registers to 170-236 (ptxas, sm_90): one program per SM instead of two.
    s_row = (su // SRC_M) * src_page + (su % SRC_M) * src_unit + a * src_outer + b * src_inner
    d_row = (du // DST_M) * dst_page + (du % DST_M) * dst_unit + a * dst_outer + b * dst_inner
    s_row += src_off + k * ROW_BLOCK
    d_row += dst_off + k * ROW_BLOCK
    s_base = tl.load(src_table + region).to(tl.pointer_type(WORD))
    d_base = tl.load(dst_table + region).to(tl.pointer_type(WORD))
    s_ptrs = s_base + (s_row[:, None] + w[None, :])
    d_ptrs = d_base + (d_row[:, None] + w[None, :])
    if ALIGNED:
        # NOTE: the tables hide the bases' alignment from the compiler: say it, so rows move as
        # 16-byte vectors (the pack kernel does the same).
        s_ptrs = tl.max_contiguous(tl.multiple_of(s_ptrs, [1, 16]), [1, ROW_BLOCK])
        d_ptrs = tl.max_contiguous(tl.multiple_of(d_ptrs, [1, 16]), [1, ROW_BLOCK])
    tl.store(d_ptrs, tl.load(s_ptrs, mask=mask, eviction_policy=EVICT), mask=mask, eviction_policy=EVICT)


def copy(
    src: KVRegions,
    dst: KVRegions,
    a: FusedArgs,
    block_words: int = _BLOCK_WORDS,
    num_warps: int = 8,
    *,
    max_row_block: int = _MAX_ROW_BLOCK,
    evict: str = "",
) -> None:
    """Launch on the source device's current stream (asynchronous)."""
    n = int(a.src_pages.size)
    if n == 0:
        return
    # NOTE: one asynchronous H2D copy of both page tables (pinned; see ``_checks.to_device``).
    pages = to_device(np.stack([a.src_pages, a.dst_pages]), src.device)
    src_pages, dst_pages = pages[0], pages[1]
    hbs = [src.head_bytes_k] + ([src.head_bytes_v] if src.v else [])
    kinds = [a.kind_geometry(src, dst, hb) for hb in hbs]
    word = pow2_divisor(
        src.min_alignment, dst.min_alignment, *(x for row, lp in kinds for x in (*row, lp.row)), cap=8
    )
    _, tl_word = _WORDS[word]
    same = len(hbs) == 1 or hbs[0] == hbs[1]
    tables = ["all" if src.v else "k"] if same else ["k", "v"]
    for name, (row, loops) in zip(tables, kinds, strict=False):
        s_ptrs = src.pointer_tables[name]
        d_ptrs = dst.pointer_tables[name]
        if d_ptrs.device != s_ptrs.device:
            d_ptrs = d_ptrs.to(s_ptrs.device)
        row_words = loops.row // word
        row_block = pow2_divisor(row_words, cap=max_row_block)
        kch = row_words // row_block
        n_chunks = n * loops.outer_count * loops.inner_count * kch
        block_c = max(1, min(block_words // row_block, triton.next_power_of_2(n_chunks)))
        grid = (triton.cdiv(n_chunks, block_c), s_ptrs.numel())
        words = [x // word for x in row]
        aligned = (
            word * row_block >= 16
            and src.min_alignment % 16 == 0
            and dst.min_alignment % 16 == 0
            and all(x % 16 == 0 for x in row)
        )
        _fused_kernel[grid](
            s_ptrs,
            d_ptrs,
            src_pages,
            dst_pages,
            n_chunks,
            *words,
            WORD=tl_word,
            SRC_M=src.page_size // a.unit,
            DST_M=dst.page_size // a.unit,
            OUTER=loops.outer_count,
            INNER=loops.inner_count,
            KCH=kch,
            ROW_BLOCK=row_block,
            BLOCK_C=block_c,
            ALIGNED=aligned,
            EVICT=evict,
            num_warps=num_warps,
        )
