"""Triton pack/unpack: one launch moves the selected pages of every layer's K and V.

Staging layout: see ``_regions``. Each program copies ``BLOCK_C`` row chunks of
``ROW_BLOCK`` words of one (slice, region) segment; a unit is ``OUTER x INNER`` runs
(``copy_loops``: a token row, a head's tokens, one head row, or the whole unit) and a run
(``ROW_WORDS`` words) is ``ROW_WORDS // ROW_BLOCK`` chunks::

    segment words:  c = ((i * OUTER + a) * INNER + b) * KCH + k      i unit, (a, b) run, k chunk
    region word:    (u // m)*page_stride + (u % m)*unit_stride + a*outer_stride + b*inner_stride
                    + head_offset + s*slice_head_stride + k*ROW_BLOCK + w     u = units[i], w < ROW_BLOCK
    staging word:   s*slice_stride + region_offset + r*region_stride + c*ROW_BLOCK + w

Bytes are moved as the widest word (8/4/2/1 bytes) that divides every address and stride,
so the dtype never matters. Region base addresses come from an int64 pointer table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import CopyArgs, PageIndices, check_copy
from ._regions import KVRegions, copy_loops, pow2_divisor, staging_strides

__all__ = ["pack", "unpack"]

_WORDS = {
    8: (torch.int64, tl.int64),
    4: (torch.int32, tl.int32),
    2: (torch.int16, tl.int16),
    1: (torch.uint8, tl.uint8),
}
_BLOCK_WORDS = 8192  # words per program: 64 KiB with int64 words (H100 sweep, bench_kernels)
_MAX_ROW_BLOCK = 64


@triton.jit
def _copy_pages_kernel(
    table_ptr,  # *int64 [regions]: base byte address of each region of this launch
    staging_ptr,  # *WORD: first word of the call's staging bytes
    units_ptr,  # *int64 [n]: region unit of the i-th selected unit (selection order)
    n_chunks,  # row chunks per (slice, region) segment: n * OUTER * INNER * KCH
    page_stride,  # words between consecutive pages of a region
    unit_stride,  # words between consecutive units of a page
    outer_stride,  # words between consecutive outer runs of a unit
    inner_stride,  # words between consecutive inner runs
    head_offset,  # words from a unit's start to slice 0's first head
    slice_head_stride,  # words between the first heads of consecutive slices
    slice_stride,  # staging words between consecutive slices
    region_stride,  # staging words between consecutive regions' segments
    region_offset,  # staging words before this launch's first segment
    gate_ptr,  # *int64 [1]: with GATED, copy only if it holds non-zero (else any pointer, unread)
    WORD: tl.constexpr,  # element type moved: int64 / int32 / int16 / uint8
    UNITS_PER_PAGE: tl.constexpr,  # m (constexpr: see the NOTE in the body)
    OUTER: tl.constexpr,  # outer runs per unit
    INNER: tl.constexpr,  # inner runs per outer run
    KCH: tl.constexpr,  # chunks per run (ROW_WORDS // ROW_BLOCK)
    ROW_BLOCK: tl.constexpr,  # contiguous words per chunk (a power of two)
    BLOCK_C: tl.constexpr,  # chunks per program (a power of two)
    ALIGNED: tl.constexpr,  # every address and stride is a multiple of 16 bytes
    TO_STAGING: tl.constexpr,  # True: pack (regions -> staging); False: unpack
    GATED: tl.constexpr,  # read ``gate_ptr`` first (an unpack behind a checksum's verdict)
):
    pid = tl.program_id(0).to(tl.int64)
    region = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2).to(tl.int64)

    c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    w = tl.arange(0, ROW_BLOCK)
    if GATED:
        # NOTE: the checksum launched ahead on this stream wrote the verdict; a batch that failed
        # it moves no byte (no chunk is live: every load and store masked off), so the engine's
        # pages stay as they were.
        n_chunks = tl.where(tl.load(gate_ptr) != 0, n_chunks, 0)
    mask_c = c < n_chunks
    mask = mask_c[:, None] & (w[None, :] < ROW_BLOCK)

    i = c // (OUTER * INNER * KCH)
    a = (c // (INNER * KCH)) % OUTER
    b = (c // KCH) % INNER
    k = c % KCH
    u = tl.load(units_ptr + i, mask=mask_c, other=0)
    # NOTE: m is a constexpr because Triton specialises a runtime int only when it is 1: any other
    # m made u // m and u % m emulated 64-bit divisions, one pair per 16-byte vector a thread
    # moves. A constexpr m (a power of two in practice) is a shift and a mask.
    row = (
        (u // UNITS_PER_PAGE) * page_stride
        + (u % UNITS_PER_PAGE) * unit_stride
        + a * outer_stride
        + b * inner_stride
        + head_offset
        + s * slice_head_stride
        + k * ROW_BLOCK
    )

    base = tl.load(table_ptr + region).to(tl.pointer_type(WORD))
    reg_ptrs = base + (row[:, None] + w[None, :])
    stg_ptrs = (
        staging_ptr
        + (s * slice_stride + region_offset + region * region_stride)
        + (c[:, None] * ROW_BLOCK + w[None, :])
    )
    if ALIGNED:
        # NOTE: the host checked 16-byte alignment; the table hides it from the compiler.
        reg_ptrs = tl.max_contiguous(tl.multiple_of(reg_ptrs, [1, 16]), [1, ROW_BLOCK])
        stg_ptrs = tl.max_contiguous(tl.multiple_of(stg_ptrs, [1, 16]), [1, ROW_BLOCK])
    if TO_STAGING:
        tl.store(stg_ptrs, tl.load(reg_ptrs, mask=mask), mask=mask)
    else:
        tl.store(reg_ptrs, tl.load(stg_ptrs, mask=mask), mask=mask)


def _launch(
    regions: KVRegions,
    args: CopyArgs,
    to_staging: bool,
    block_words: int,
    num_warps: int,
    gate: torch.Tensor | None = None,
) -> None:
    n, h, g = args.pages.numel(), args.num_heads, args.unit
    if n == 0:
        return
    hbs = [regions.head_bytes_k] + ([regions.head_bytes_v] if regions.v else [])
    staging_addr = args.staging.data_ptr()
    strides = [regions.strides(hb) for hb in hbs]
    word = pow2_divisor(
        regions.min_alignment, staging_addr, *hbs, *(st for trio in strides for st in trio), cap=8
    )
    seg_bytes = [n * g * h * hb for hb in hbs]
    slice_bytes = regions.num_layers * sum(seg_bytes)
    if len(hbs) == 1 or hbs[0] == hbs[1]:
        launches = [("all" if regions.v else "k", 0, seg_bytes[0], 0)]
    else:  # K and V rows differ in width: one launch each, segments interleaved by layer
        launches = [("k", 0, sum(seg_bytes), 0), ("v", 1, sum(seg_bytes), seg_bytes[0])]
    torch_word, tl_word = _WORDS[word]
    staging = args.staging.view(torch_word)
    for table, kind, region_stride, region_offset in launches:
        ptrs = regions.pointer_tables[table]
        hb, (page, token, head) = hbs[kind], strides[kind]
        loops = copy_loops(
            g, h, hb, (token, head), staging_strides(g, h, hb, args.head_major), args.head_major
        )
        row_words = loops.row // word
        row_block = pow2_divisor(row_words, cap=_MAX_ROW_BLOCK)
        kch = row_words // row_block
        n_chunks = n * loops.outer_count * loops.inner_count * kch
        block_c = max(1, min(block_words // row_block, triton.next_power_of_2(n_chunks)))
        strides_bytes = (page, g * token, *loops.src, args.head_start * head, h * head)
        aligned = (
            word * row_block >= 16
            and regions.min_alignment == 16
            and staging_addr % 16 == 0
            and all(b % 16 == 0 for b in (*strides_bytes, slice_bytes, region_stride, region_offset))
        )
        grid = (triton.cdiv(n_chunks, block_c), ptrs.numel(), args.num_slices)
        _copy_pages_kernel[grid](
            ptrs,
            staging,
            args.pages,
            n_chunks,
            *(b // word for b in strides_bytes),
            slice_bytes // word,
            region_stride // word,
            region_offset // word,
            args.pages if gate is None else gate,
            WORD=tl_word,
            UNITS_PER_PAGE=args.units_per_page(regions),
            OUTER=loops.outer_count,
            INNER=loops.inner_count,
            KCH=kch,
            ROW_BLOCK=row_block,
            BLOCK_C=block_c,
            ALIGNED=aligned,
            TO_STAGING=to_staging,
            GATED=gate is not None,
            num_warps=num_warps,
        )


def pack(
    regions: KVRegions,
    pages: PageIndices,
    out: torch.Tensor | None = None,
    *,
    head_start: int = 0,
    num_heads: int | None = None,
    num_slices: int = 1,
    unit: int | None = None,
    head_major: bool | None = None,
    block_words: int = _BLOCK_WORDS,
    num_warps: int = 8,
) -> torch.Tensor:
    """Triton version of :func:`kvservice.kernels.reference.pack` (same contract, async on CUDA)."""
    args = check_copy(
        regions,
        pages,
        out,
        head_start,
        num_heads,
        num_slices,
        to_staging=True,
        unit=unit,
        head_major=head_major,
    )
    _launch(regions, args, True, block_words, num_warps)
    return args.staging


def unpack(
    regions: KVRegions,
    staging: torch.Tensor,
    pages: PageIndices,
    *,
    head_start: int = 0,
    num_heads: int | None = None,
    num_slices: int = 1,
    unit: int | None = None,
    head_major: bool | None = None,
    block_words: int = _BLOCK_WORDS,
    num_warps: int = 8,
    gate: torch.Tensor | None = None,
) -> None:
    """Triton version of :func:`kvservice.kernels.reference.unpack` (same contract, async on CUDA);
    with ``gate`` (int64 [1] on the regions' device) the kernel copies only if it reads non-zero."""
    args = check_copy(
        regions,
        pages,
        staging,
        head_start,
        num_heads,
        num_slices,
        to_staging=False,
        unit=unit,
        head_major=head_major,
    )
    _launch(regions, args, False, block_words, num_warps, gate)
