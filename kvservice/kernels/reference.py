"""Pack/unpack in plain torch: the CPU path and the oracle the Triton kernels are tested against.

Same contract and staging layout as the kernels (see ``_regions``); works on bytes, so any
dtype. One vectorised ``index_select``/``index_copy_`` per region (layer x K/V), never a loop
per page.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ._checks import CopyArgs, PageIndices, check_copy
from ._regions import KVRegions, pow2_divisor

__all__ = ["pack", "unpack"]

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def unit_view(
    regions: KVRegions, region: torch.Tensor, head_bytes: int, unit: int, word: int
) -> torch.Tensor:
    """``region`` as ``[num_pages, m, unit, heads, head_bytes / word]`` words (``m`` units a page),
    strided as its page layout says (``_regions``): a view, so writes land in the region."""
    ps, ts, hs = regions.strides(head_bytes)
    words = region.reshape(-1).view(torch.uint8).view(_WORDS[word])
    m = regions.page_size // unit
    size = (regions.num_pages, m, unit, regions.num_heads, head_bytes // word)
    return torch.as_strided(words, size, (ps // word, unit * ts // word, ts // word, hs // word, 1))


def _segments(regions: KVRegions, args: CopyArgs) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (region as ``unit_view``, staging as [S, n, g, h, words] or [S, n, h, g, words]).

    Rows are viewed as the widest word dividing every address and stride, since torch's
    index ops on CPU are several times faster on int64 than on bytes.
    """
    n, h, s, g = args.pages.numel(), args.num_heads, args.num_slices, args.unit
    by_slice = args.staging.view(s, -1)
    off = 0
    head_bytes = (regions.head_bytes_k, regions.head_bytes_v) if regions.v else (regions.head_bytes_k,)
    for i, reg in enumerate(regions.regions):
        hb = head_bytes[i % len(head_bytes)]
        seg = n * g * h * hb
        staged = by_slice[:, off : off + seg]
        word = pow2_divisor(*regions.strides(hb), hb, reg.data_ptr(), staged.data_ptr(), cap=8)
        shape = (s, n, h, g, hb) if args.head_major else (s, n, g, h, hb)
        staged = staged.view(shape).view(_WORDS[word])
        yield unit_view(regions, reg, hb, g, word), staged
        off += seg


def _split(args: CopyArgs, regions: KVRegions) -> tuple[torch.Tensor, torch.Tensor]:
    m = args.units_per_page(regions)
    return args.pages // m, args.pages % m


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
) -> torch.Tensor:
    """Gather ``pages`` (units of ``unit`` tokens) of every region into ``out`` (allocated if
    None); return the packed bytes.

    Heads ``head_start + s*num_heads + [0, num_heads)`` go to slice ``s``. Raises InvalidArgument.
    """
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
    if args.pages.numel():
        hs, he = args.head_start, args.head_start + args.num_slices * args.num_heads
        pi, ki = _split(args, regions)
        for view, staged in _segments(regions, args):
            sel = view[pi, ki][:, :, hs:he]
            sel = sel.reshape(sel.shape[0], sel.shape[1], args.num_slices, args.num_heads, -1)
            staged.copy_(sel.permute(2, 0, 3, 1, 4) if args.head_major else sel.permute(2, 0, 1, 3, 4))
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
) -> None:
    """Scatter packed ``staging`` into the distinct destination ``pages`` (units) at ``head_start``.

    Only the named units' heads ``[head_start, head_start + num_slices*num_heads)`` change.
    """
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
    if not args.pages.numel():
        return
    hs, he = args.head_start, args.head_start + args.num_slices * args.num_heads
    pi, ki = _split(args, regions)
    for view, staged in _segments(regions, args):
        n, g = args.pages.numel(), args.unit
        order = (1, 3, 0, 2, 4) if args.head_major else (1, 2, 0, 3, 4)
        data = staged.permute(*order).reshape(n, g, he - hs, -1).to(view.device)
        # NOTE: write only the head slice: a whole-page read-modify-write would race with another
        # sender's unpack of other heads of the same pages (sender TP > receiver TP).
        view[pi, ki, :, hs:he] = data
