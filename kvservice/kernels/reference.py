"""Pack/unpack in plain torch: the CPU path and the oracle the Triton kernels are tested against.

Same contract and staging layout as the kernels (see ``_regions``); works on bytes, so any
dtype. One vectorised ``index_select``/``index_copy_`` per region (layer x K/V), never a loop
per page.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ._checks import CopyArgs, PageIndices, check_copy
from ._regions import KVRegions

__all__ = ["pack", "unpack"]

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _segments(regions: KVRegions, args: CopyArgs) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (region as [pages, page_size, heads, words], staging as [S, n, page_size, h, words]).

    Rows are viewed as the widest word dividing every address and row, since torch's
    index ops on CPU are several times faster on int64 than on bytes.
    """
    n, h, s, ps = args.pages.numel(), args.num_heads, args.num_slices, regions.page_size
    by_slice = args.staging.view(s, -1)
    off = 0
    head_bytes = (regions.head_bytes_k, regions.head_bytes_v) if regions.v else (regions.head_bytes_k,)
    for i, reg in enumerate(regions.regions):
        hb = head_bytes[i % len(head_bytes)]
        seg = n * ps * h * hb
        region = reg.reshape(-1).view(torch.uint8).view(regions.num_pages, ps, regions.num_heads, hb)
        staged = by_slice[:, off : off + seg].view(s, n, ps, h, hb)
        word = next(w for w in (8, 4, 2, 1) if (hb | region.data_ptr() | staged.data_ptr()) % w == 0)
        yield region.view(_WORDS[word]), staged.view(_WORDS[word])
        off += seg


def pack(
    regions: KVRegions,
    pages: PageIndices,
    out: torch.Tensor | None = None,
    *,
    head_start: int = 0,
    num_heads: int | None = None,
    num_slices: int = 1,
) -> torch.Tensor:
    """Gather ``pages`` of every region into ``out`` (allocated if None); return the packed bytes.

    Heads ``head_start + s*num_heads + [0, num_heads)`` go to slice ``s``. Raises InvalidArgument.
    """
    args = check_copy(regions, pages, out, head_start, num_heads, num_slices, to_staging=True)
    if args.pages.numel():
        hs, he = args.head_start, args.head_start + args.num_slices * args.num_heads
        for region, staged in _segments(regions, args):
            sel = region.index_select(0, args.pages)[:, :, hs:he]
            sel = sel.reshape(sel.shape[0], sel.shape[1], args.num_slices, args.num_heads, -1)
            staged.copy_(sel.permute(2, 0, 1, 3, 4))
    return args.staging


def unpack(
    regions: KVRegions,
    staging: torch.Tensor,
    pages: PageIndices,
    *,
    head_start: int = 0,
    num_heads: int | None = None,
    num_slices: int = 1,
) -> None:
    """Scatter packed ``staging`` into the distinct destination ``pages`` at ``head_start``.

    Only the named pages' heads ``[head_start, head_start + num_slices*num_heads)`` change.
    """
    args = check_copy(regions, pages, staging, head_start, num_heads, num_slices, to_staging=False)
    if not args.pages.numel():
        return
    hs, he = args.head_start, args.head_start + args.num_slices * args.num_heads
    for region, staged in _segments(regions, args):
        n, ps = staged.shape[1], staged.shape[2]
        data = staged.permute(1, 2, 0, 3, 4).reshape(n, ps, he - hs, -1).to(region.device)
        # NOTE: write only the head slice: a whole-page read-modify-write would race with another
        # sender's unpack of other heads of the same pages (sender TP > receiver TP).
        target = region if he - hs == regions.num_heads else region[:, :, hs:he]
        target.index_copy_(0, args.pages, data)
