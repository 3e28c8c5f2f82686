"""Vectorised address math: page indices → transport descriptors. No Python loop per page.

A buffer set has ``R`` regions (MHA: K of layers 0..L-1, then V of layers 0..L-1; MLA: one per
layer); page ``p`` of region ``r`` is the bytes ``[base[r] + p*pb[r], base[r] + (p+1)*pb[r])``.
The delta to send is two equal-length page-index arrays, ``src`` (sender) and ``dst`` (receiver).

Descriptor arrays are (N, 3) int64 ``[addr, len, dev]``, region-major::

    region 0: page/run 0, 1, ... M-1 | region 1: page/run 0 ... | ... | region R-1

Run merge: ``src = [4, 5, 6, 9, 10]``, ``dst = [0, 1, 7, 8, 9]`` → runs start where either side
breaks contiguity: ``(4→0, 2 pages) (6→7, 1) (9→8, 2)``; a run of ``n`` pages is one descriptor
of ``n*pb[r]`` bytes per region.

Prepped lists: one strided (N, 5) row ``(base, pb, dev, pb, num_pages)`` per region, so element
``r*num_pages + p`` is page ``p`` of region ``r`` (``prepped_rows`` / ``prepped_indices``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument

__all__ = [
    "CALIBRATIONS",
    "Calibration",
    "DescriptorPlan",
    "IndexPlan",
    "ListGeometry",
    "choose_path",
    "fit_calibration",
    "page_descriptors",
    "page_runs",
    "prepped_indices",
    "prepped_rows",
    "run_descriptors",
]

_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class DescriptorPlan:
    """Matching local/remote descriptor arrays: row ``i`` of ``local`` goes to row ``i`` of ``remote``."""

    local: np.ndarray  # (N, 3) int64
    remote: np.ndarray  # (N, 3) int64
    count: int
    total_bytes: int


@dataclass(frozen=True)
class IndexPlan:
    """Index arrays into prepped per-(region, page) lists, for ``Transport.write``."""

    local_idx: np.ndarray  # (N,) int32
    remote_idx: np.ndarray  # (N,) int32
    count: int
    total_bytes: int


def _pages(name: str, pages: np.ndarray, num_pages: int | None) -> np.ndarray:
    arr = np.asarray(pages)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(name, "must be a 1-D integer array")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise InvalidArgument(name, "page indices must be >= 0")
    if num_pages is not None and arr.size and arr.max() >= num_pages:
        raise InvalidArgument(name, f"page index {int(arr.max())} >= num_pages {num_pages}")
    return arr


def _per_region(name: str, values: np.ndarray | int, regions: int) -> np.ndarray:
    arr = np.broadcast_to(np.asarray(values, dtype=np.int64), (regions,))
    if arr.size and arr.min() <= 0:
        raise InvalidArgument(name, "must be > 0")
    return arr


def _check_pair(src: np.ndarray, dst: np.ndarray) -> None:
    if src.shape != dst.shape:
        raise InvalidArgument("dst_pages", f"length {dst.size} differs from src_pages length {src.size}")


def page_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run-length merge on both sides: ``(src_start, dst_start, length)`` arrays of the runs."""
    src = _pages("src_pages", src, None)
    dst = _pages("dst_pages", dst, None)
    _check_pair(src, dst)
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    # NOTE: a run continues at i iff BOTH sides advance by exactly one page.
    cont = (np.diff(src) == 1) & (np.diff(dst) == 1)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.diff(np.append(starts, src.size))
    return src[starts], dst[starts], lengths


def _descs(bases: np.ndarray, pb: np.ndarray, dev: int, first: np.ndarray, npages: np.ndarray) -> np.ndarray:
    out = np.empty((bases.size, first.size, 3), dtype=np.int64)
    out[:, :, 0] = bases[:, None] + first[None, :] * pb[:, None]
    out[:, :, 1] = npages[None, :] * pb[:, None]
    out[:, :, 2] = dev
    return out.reshape(-1, 3)


def _plan(
    src_bases: np.ndarray,
    dst_bases: np.ndarray,
    page_bytes: np.ndarray | int,
    src_first: np.ndarray,
    dst_first: np.ndarray,
    npages: np.ndarray,
    src_dev: int,
    dst_dev: int,
) -> DescriptorPlan:
    sb = np.asarray(src_bases, dtype=np.int64).reshape(-1)
    db = np.asarray(dst_bases, dtype=np.int64).reshape(-1)
    if sb.size != db.size:
        raise InvalidArgument("dst_bases", f"{db.size} regions, sender has {sb.size}")
    pb = _per_region("page_bytes", page_bytes, sb.size)
    local = _descs(sb, pb, src_dev, src_first, npages)
    remote = _descs(db, pb, dst_dev, dst_first, npages)
    return DescriptorPlan(local, remote, int(local.shape[0]), int(local[:, 1].sum()))


def page_descriptors(
    src_bases: np.ndarray,
    dst_bases: np.ndarray,
    page_bytes: np.ndarray | int,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    src_dev: int = 0,
    dst_dev: int = 0,
) -> DescriptorPlan:
    """(a) One descriptor per (region, page): ``R * len(src_pages)`` rows, region-major."""
    src = _pages("src_pages", src_pages, None)
    dst = _pages("dst_pages", dst_pages, None)
    _check_pair(src, dst)
    return _plan(src_bases, dst_bases, page_bytes, src, dst, np.ones_like(src), src_dev, dst_dev)


def run_descriptors(
    src_bases: np.ndarray,
    dst_bases: np.ndarray,
    page_bytes: np.ndarray | int,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    src_dev: int = 0,
    dst_dev: int = 0,
) -> DescriptorPlan:
    """(b) One descriptor per (region, run) after merging runs contiguous on both sides."""
    s0, d0, n = page_runs(src_pages, dst_pages)
    return _plan(src_bases, dst_bases, page_bytes, s0, d0, n, src_dev, dst_dev)


def prepped_rows(bases: np.ndarray, page_bytes: np.ndarray | int, num_pages: int, dev: int = 0) -> np.ndarray:
    """Strided (R, 5) rows ``(base, pb, dev, pb, num_pages)``: one prepped list for a buffer set."""
    b = np.asarray(bases, dtype=np.int64).reshape(-1)
    if num_pages <= 0:
        raise InvalidArgument("num_pages", "must be > 0")
    if b.size * num_pages > _INT32_MAX:
        raise InvalidArgument("num_pages", "regions * num_pages exceeds the int32 index range")
    pb = _per_region("page_bytes", page_bytes, b.size)
    return np.stack([b, pb, np.full_like(b, dev), pb, np.full_like(b, num_pages)], axis=1)


def prepped_indices(
    num_regions: int,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    src_num_pages: int,
    dst_num_pages: int,
    page_bytes: np.ndarray | int = 0,
) -> IndexPlan:
    """Index arrays ``r*num_pages + p`` (region-major) into two ``prepped_rows`` lists.

    ``total_bytes`` is filled when ``page_bytes`` (scalar or per region) is given.
    """
    src = _pages("src_pages", src_pages, src_num_pages)
    dst = _pages("dst_pages", dst_pages, dst_num_pages)
    _check_pair(src, dst)
    if num_regions * max(src_num_pages, dst_num_pages) > _INT32_MAX:
        raise InvalidArgument("num_pages", "regions * num_pages exceeds the int32 index range")
    r = np.arange(num_regions, dtype=np.int64)[:, None]
    li = (r * src_num_pages + src[None, :]).reshape(-1).astype(np.int32)
    ri = (r * dst_num_pages + dst[None, :]).reshape(-1).astype(np.int32)
    pb = np.broadcast_to(np.asarray(page_bytes, dtype=np.int64), (num_regions,))
    return IndexPlan(li, ri, int(li.size), int(pb.sum()) * int(src.size))


@dataclass(frozen=True)
class ListGeometry:
    """Shape of a descriptor list given as (N, 3) or strided (N, 5) rows, without expanding it.

    Elements are numbered row-major; ``ends[j]`` is one past the last element of row ``j``.
    """

    rows: np.ndarray  # (N, 5) int64: addr, len, dev, stride, count
    ends: np.ndarray  # (N,) int64
    count: int

    @classmethod
    def of(cls, regions: np.ndarray) -> ListGeometry:
        """Validate an (N, 3) or (N, 5) integer array; raises InvalidArgument naming ``regions``."""
        arr = np.asarray(regions)
        if arr.ndim != 2 or arr.shape[1] not in (3, 5) or arr.shape[0] == 0 or arr.dtype.kind not in "iu":
            raise InvalidArgument("regions", "must be a non-empty (N, 3) or (N, 5) integer array")
        arr = arr.astype(np.int64, copy=False)
        if arr.shape[1] == 3:
            arr = np.concatenate([arr, arr[:, 1:2], np.ones_like(arr[:, :1])], axis=1)
        if arr[:, 0].min() <= 0 or arr[:, 1].min() <= 0 or arr[:, 2].min() < 0:
            raise InvalidArgument("regions", "addresses and lengths must be > 0, devices >= 0")
        if arr[:, 3].min() < 0 or arr[:, 4].min() <= 0:
            raise InvalidArgument("regions", "stride must be >= 0 and count > 0")
        ends = np.cumsum(arr[:, 4])
        return cls(arr, ends, int(ends[-1]))

    def spans(self) -> np.ndarray:
        """(N, 2) ``[first byte, one past last byte]`` of every row."""
        r = self.rows
        return np.stack([r[:, 0], r[:, 0] + (r[:, 4] - 1) * r[:, 3] + r[:, 1]], axis=1)

    def select(self, idx: np.ndarray) -> np.ndarray:
        """(len(idx), 3) ``[addr, len, dev]`` of the elements ``idx`` (assumed in range)."""
        row = np.searchsorted(self.ends, idx, side="right")
        k = idx - (self.ends[row] - self.rows[row, 4])
        r = self.rows[row]
        return np.stack([r[:, 0] + k * r[:, 3], r[:, 1], r[:, 2]], axis=1)


@dataclass(frozen=True)
class Calibration:
    """Cost constants of one transport kind.

    ``per_desc_s``: extra time per descriptor on the wire path; ``wire_bps``: bulk bandwidth;
    ``copy_bps``: bandwidth of ONE pack (or unpack) copy; ``pack_fixed_s``: launch/sync cost of
    pack + unpack.
    """

    per_desc_s: float
    wire_bps: float
    copy_bps: float
    pack_fixed_s: float = 0.0


# Defaults fitted to measured NIXL 1.5.1 numbers (DESIGN.md table; CPU row re-measured here with
# bench/bench_transport.py). Override from config or with fit_calibration at start-up.
CALIBRATIONS: dict[str, Calibration] = {
    # H100 same GPU, cuda_ipc: 65,536 descs 904 ms vs 1 desc 2.0 ms, packed 9.2 ms on 2 GiB.
    "nixl-vram": Calibration(per_desc_s=13.8e-6, wire_bps=1.07e12, copy_bps=6.0e11, pack_fixed_s=50e-6),
    # CPU DRAM, UCX cma (default UCX_TLS); measured here, see nixl_transport.py's docstring.
    "nixl-dram": Calibration(per_desc_s=12.7e-6, wire_bps=2.5e9, copy_bps=3.6e9, pack_fixed_s=20e-6),
    # CPU DRAM, UCX_TLS=tcp.
    "nixl-dram-tcp": Calibration(per_desc_s=25e-6, wire_bps=1.2e9, copy_bps=3.6e9, pack_fixed_s=20e-6),
    # Same-process memmove double: per-descriptor cost is a Python call.
    "loopback": Calibration(per_desc_s=1.0e-6, wire_bps=8.0e9, copy_bps=8.0e9, pack_fixed_s=10e-6),
}


def fit_calibration(
    one_desc_s: float,
    many_desc_s: float,
    num_descriptors: int,
    total_bytes: int,
    copy_s: float,
    pack_fixed_s: float = 0.0,
) -> Calibration:
    """Calibration from a start-up measurement of the same ``total_bytes`` moved as one
    descriptor (``one_desc_s``), as ``num_descriptors`` descriptors (``many_desc_s``), and one
    local copy of it (``copy_s``)."""
    if num_descriptors < 2 or total_bytes <= 0 or min(one_desc_s, many_desc_s, copy_s) <= 0:
        raise InvalidArgument("calibration", "needs >= 2 descriptors, bytes > 0 and positive times")
    per_desc = max(many_desc_s - one_desc_s, 0.0) / (num_descriptors - 1)
    return Calibration(per_desc, total_bytes / one_desc_s, total_bytes / copy_s, pack_fixed_s)


def choose_path(
    num_descriptors: int, total_bytes: int, transport_kind: str, calibration: Calibration | None = None
) -> str:
    """``'packed'`` iff the descriptors saved cost more than the two extra copies::

        direct = D * per_desc + B / wire
        packed = 1 * per_desc + B / wire + 2 * B / copy + pack_fixed
        packed wins  <=>  (D - 1) * per_desc > 2 * B / copy + pack_fixed

    i.e. when the mean descriptor is smaller than ``2 * per_desc * copy`` bytes (roughly 9 KB
    on CPU DRAM, 16 MB on a GPU). Unknown kinds without a calibration raise InvalidArgument.
    """
    cal = calibration or CALIBRATIONS.get(transport_kind)
    if cal is None:
        raise InvalidArgument("transport_kind", f"no calibration for {transport_kind!r}")
    if num_descriptors <= 1:
        return "direct"
    saved = (num_descriptors - 1) * cal.per_desc_s
    extra = 2.0 * total_bytes / cal.copy_bps + cal.pack_fixed_s
    return "packed" if saved > extra else "direct"
