"""Argument checks shared by every pack/unpack backend: a bad call raises and changes nothing.

All page checks are vectorised (one min/max and one distinctness pass over the array), never a
loop per page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import InvalidArgument
from ._regions import KVRegions, check_unit, packed_nbytes

__all__ = ["CopyArgs", "check_copy", "distinct", "host_pages", "pages_tensor", "to_device"]

_BITMAP_PER_INDEX = 64  # bitmap bytes an index may cost before a sort is cheaper

PageIndices = torch.Tensor | np.ndarray | Sequence[int]


@dataclasses.dataclass(frozen=True)
class CopyArgs:
    """A checked pack/unpack call. ``staging`` is a 1-D uint8 view of exactly the packed bytes."""

    pages: torch.Tensor  # int64 [n] on the regions' device, selection order: units of ``unit`` tokens
    staging: torch.Tensor
    head_start: int
    num_heads: int
    num_slices: int
    unit: int  # tokens per unit (a whole page unless the call named a smaller unit)
    head_major: bool  # staging order inside a unit (see ``_regions``)

    def units_per_page(self, regions: KVRegions) -> int:
        return regions.page_size // self.unit


def host_pages(
    values: PageIndices, regions: KVRegions, unique: bool, field: str = "pages", units_per_page: int = 1
) -> np.ndarray:
    """Check page indices on the host (vectorised, numpy: a few µs for a few pages); an int64 array."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise InvalidArgument(field, f"must be integers, got {values.dtype}")
        values = values.cpu().numpy()
    a = np.asarray(values)
    if a.ndim != 1:
        raise InvalidArgument(field, f"must be 1-D, got {a.ndim}-D")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InvalidArgument(field, f"must be integers, got {a.dtype}")
    a = a.astype(np.int64, copy=False)
    if a.size:
        lo, hi, top = int(a.min()), int(a.max()), regions.num_pages * units_per_page
        if lo < 0 or hi >= top:
            raise InvalidArgument(field, f"indices must be in [0, {top}), got [{lo}, {hi}]")
        if unique and not distinct(a, top):
            raise InvalidArgument(field, "destination pages must be distinct")
    return a


def distinct(a: np.ndarray, top: int) -> bool:
    """Whether the int64 indices ``a`` (all in ``[0, top)``) are pairwise distinct.

    Strictly increasing (the usual allocator order) proves it in one pass; other orders mark a
    bitmap of the index range when that is at most ``_BITMAP_PER_INDEX`` bytes an index, else
    sort. (``np.unique`` costs ~2 ms for 16k indices with numpy 2.x: more than the kernel that
    scatters 2 GiB into them, and every page-1 receiver names one index per token.)
    """
    if a.size < 2 or bool((a[1:] > a[:-1]).all()):
        return True
    if top <= _BITMAP_PER_INDEX * a.size:
        seen = np.zeros(top, dtype=np.bool_)
        seen[a] = True
        return int(np.count_nonzero(seen)) == a.size
    s = np.sort(a)
    return not bool((s[1:] == s[:-1]).any())


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` (int64) as a tensor on ``device``: for CUDA one asynchronous copy on the current
    stream from pinned memory (torch's caching host allocator keeps the block until that stream
    passed the copy); a pageable source would make it a synchronous copy that also waits for the
    stream's earlier work, on the calling (loop) thread."""
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(a))
    host = torch.empty(a.shape, dtype=torch.int64, pin_memory=True)
    host.numpy()[...] = a
    return host.to(device, non_blocking=True)


def pages_tensor(
    pages: PageIndices, regions: KVRegions, unique: bool, field: str = "pages", units_per_page: int = 1
) -> torch.Tensor:
    """Check on whichever side the indices live (host indices: no device sync), then move."""
    if isinstance(pages, torch.Tensor) and pages.device.type != "cpu":
        if pages.ndim != 1:
            raise InvalidArgument(field, f"must be 1-D, got {pages.ndim}-D")
        if pages.dtype.is_floating_point or pages.dtype.is_complex or pages.dtype == torch.bool:
            raise InvalidArgument(field, f"must be integers, got {pages.dtype}")
        t = pages.to(torch.int64)
        if t.numel():
            lo, hi = (int(x) for x in torch.aminmax(t))
            top = regions.num_pages * units_per_page
            if lo < 0 or hi >= top:
                raise InvalidArgument(field, f"indices must be in [0, {top}), got [{lo}, {hi}]")
            if unique and torch.unique(t).numel() != t.numel():
                raise InvalidArgument(field, "destination pages must be distinct")
        return t.to(regions.device).contiguous()
    return to_device(host_pages(pages, regions, unique, field, units_per_page), regions.device)


def _staging_bytes(staging: torch.Tensor, regions: KVRegions, nbytes: int) -> torch.Tensor:
    if not staging.is_contiguous():
        raise InvalidArgument("staging", "must be contiguous")
    dev = staging.device
    ok = dev == regions.device or (
        regions.device.type == "cuda" and dev.type == "cpu" and staging.is_pinned()
    )
    if not ok:
        raise InvalidArgument(
            "staging", f"on {dev}; regions are on {regions.device} (host staging must be pinned)"
        )
    flat = staging.reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise InvalidArgument("staging", f"{flat.numel()} bytes, need {nbytes}")
    return flat[:nbytes]


def check_copy(
    regions: KVRegions,
    pages: PageIndices,
    staging: torch.Tensor | None,
    head_start: int,
    num_heads: int | None,
    num_slices: int,
    *,
    to_staging: bool,
    unit: int | None = None,
    head_major: bool | None = None,
) -> CopyArgs:
    """Check a pack (``to_staging``) or unpack call; allocate the staging of a pack if None.

    Heads ``[head_start, head_start + num_slices * num_heads)`` must lie in the local heads;
    unpack's pages must be distinct (two writes to one page would race). ``unit`` (tokens,
    dividing the page size; default a page) makes ``pages`` unit indices; ``head_major`` is the
    staging order (default the pool's own).
    """
    g = check_unit(unit, regions.page_size)
    nh = regions.num_heads - head_start if num_heads is None else num_heads
    if num_slices < 1:
        raise InvalidArgument("num_slices", f"must be >= 1, got {num_slices}")
    if head_start < 0 or nh < 1 or head_start + num_slices * nh > regions.num_heads:
        raise InvalidArgument(
            "head_start",
            f"heads [{head_start}, {head_start + num_slices * nh}) not within the "
            f"{regions.num_heads} local heads",
        )
    idx = pages_tensor(pages, regions, unique=not to_staging, units_per_page=regions.page_size // g)
    nbytes = packed_nbytes(regions, idx.numel(), nh, num_slices, g)
    if staging is None:
        if not to_staging:
            raise InvalidArgument("staging", "required for unpack")
        staging = torch.empty(nbytes, dtype=torch.uint8, device=regions.device)
    order = regions.head_major if head_major is None else head_major
    return CopyArgs(idx, _staging_bytes(staging, regions, nbytes), head_start, nh, num_slices, g, order)
