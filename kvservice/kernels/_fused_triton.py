"""Triton fused copy: one launch reads source pages and writes destination pages of every region.

Each program copies ``BLOCK_C`` row chunks of ``ROW_BLOCK`` words of one region; a copied token
row (``num_heads * head_bytes``) is ``KCH`` chunks::

    chunk c = (i * PAGE_SIZE + t) * KCH + k          i page of the call, t token, k chunk of the row
    src word = src_pages[i]*src_page + t*src_token + src_off + k*ROW_BLOCK + w
    dst word = dst_pages[i]*dst_page + t*dst_token + dst_off + k*ROW_BLOCK + w

Base addresses come from one int64 table per side, so the destination may live on a peer GPU
(the launch runs on the source device and writes through peer access) — the caller enables
peer access first. Words are the widest size (8/4/2/1 bytes) dividing every address and stride.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ._regions import KVRegions
from ._triton import _WORDS, _pow2_divisor

if TYPE_CHECKING:
    from .fused import FusedArgs

__all__ = ["copy"]

_BLOCK_WORDS = 8192
_MAX_ROW_BLOCK = 64


@triton.jit
def _fused_kernel(
    src_table,  # *int64 [regions]: base byte address of each source region
    dst_table,  # *int64 [regions]: base byte address of each destination region
    src_pages_ptr,  # *int64 [n]
    dst_pages_ptr,  # *int64 [n]
    n_chunks,  # n * PAGE_SIZE * KCH
    src_page,  # words between consecutive source pages
    src_token,  # words between consecutive source tokens
    src_off,  # words from a source token's start to the first copied head
    dst_page,
    dst_token,
    dst_off,
    WORD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KCH: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    region = tl.program_id(1).to(tl.int64)
    c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    w = tl.arange(0, ROW_BLOCK)
    mask_c = c < n_chunks
    mask = mask_c[:, None] & (w[None, :] < ROW_BLOCK)
    i = c // (PAGE_SIZE * KCH)
    t = (c // KCH) % PAGE_SIZE
    k = c % KCH
    sp = tl.load(src_pages_ptr + i, mask=mask_c, other=0)
    dp = tl.load(dst_pages_ptr + i, mask=mask_c, other=0)
    s_row = sp * src_page + t * src_token + src_off + k * ROW_BLOCK
    d_row = dp * dst_page + t * dst_token + dst_off + k * ROW_BLOCK
    s_base = tl.load(src_table + region).to(tl.pointer_type(WORD))
    d_base = tl.load(dst_table + region).to(tl.pointer_type(WORD))
    vals = tl.load(s_base + (s_row[:, None] + w[None, :]), mask=mask)
    tl.store(d_base + (d_row[:, None] + w[None, :]), vals, mask=mask)


def copy(src: KVRegions, dst: KVRegions, a: FusedArgs, block_words: int = _BLOCK_WORDS) -> None:
    """Launch on the source device's current stream (asynchronous)."""
    n, h, ps = int(a.src_pages.size), a.num_heads, src.page_size
    if n == 0:
        return
    src_pages = torch.from_numpy(a.src_pages).to(src.device, non_blocking=True)
    dst_pages = torch.from_numpy(a.dst_pages).to(src.device, non_blocking=True)
    hbs = [src.head_bytes_k] + ([src.head_bytes_v] if src.v else [])
    word = min(
        8,
        src.min_alignment,
        dst.min_alignment,
        *(_pow2_divisor(hb, 8) for hb in hbs),
    )
    _, tl_word = _WORDS[word]
    same = len(hbs) == 1 or hbs[0] == hbs[1]
    tables = ["all" if src.v else "k"] if same else ["k", "v"]
    for name, hb in zip(tables, hbs, strict=False):
        s_ptrs = src.pointer_tables[name]
        d_ptrs = dst.pointer_tables[name]
        if d_ptrs.device != s_ptrs.device:
            d_ptrs = d_ptrs.to(s_ptrs.device)
        row_words = h * hb // word
        row_block = _pow2_divisor(row_words, _MAX_ROW_BLOCK)
        kch = row_words // row_block
        n_chunks = n * ps * kch
        block_c = max(1, min(block_words // row_block, triton.next_power_of_2(n_chunks)))
        grid = (triton.cdiv(n_chunks, block_c), s_ptrs.numel())
        _fused_kernel[grid](
            s_ptrs,
            d_ptrs,
            src_pages,
            dst_pages,
            n_chunks,
            ps * src.num_heads * hb // word,
            src.num_heads * hb // word,
            a.src_head_start * hb // word,
            ps * dst.num_heads * hb // word,
            dst.num_heads * hb // word,
            a.dst_head_start * hb // word,
            WORD=tl_word,
            PAGE_SIZE=ps,
            KCH=kch,
            ROW_BLOCK=row_block,
            BLOCK_C=block_c,
            num_warps=8,
        )
