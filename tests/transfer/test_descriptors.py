"""Descriptor math against naive per-page Python references on random inputs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvservice.errors import InvalidArgument
from kvservice.transfer.descriptors import (
    CALIBRATIONS,
    ListGeometry,
    choose_path,
    fit_calibration,
    page_descriptors,
    page_runs,
    prepped_indices,
    prepped_rows,
    run_descriptors,
)

SEEDS = range(20)


def _case(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(seed)
    regions, pages = int(rng.integers(1, 9)), int(rng.integers(1, 200))
    n = int(rng.integers(0, pages + 1))
    src = np.sort(rng.choice(pages, n, replace=False)) if seed % 2 else rng.choice(pages, n, replace=False)
    dst = np.sort(rng.choice(pages, n, replace=False))
    if seed % 3 == 0 and n:  # make long runs likely
        src = np.arange(n) + int(rng.integers(0, pages - n + 1))
    sb = (rng.integers(1, 1 << 20, regions) << 20).astype(np.int64)
    db = (rng.integers(1, 1 << 20, regions) << 20).astype(np.int64)
    return sb, db, src, dst, pages


def _naive_pages(
    sb: np.ndarray, db: np.ndarray, pb: int, src: np.ndarray, dst: np.ndarray
) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    rows = [
        ((s0 + s * pb, pb, 0), (d0 + d * pb, pb, 0))
        for s0, d0 in zip(sb, db, strict=True)
        for s, d in zip(src, dst, strict=True)
    ]
    return rows


def _naive_runs(src: np.ndarray, dst: np.ndarray) -> list[list[int]]:
    runs: list[list[int]] = []
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


@pytest.mark.parametrize("seed", SEEDS)
def test_page_descriptors_match_naive(seed: int) -> None:
    """Per-(region, page) descriptors equal the naive double loop, region-major."""
    sb, db, src, dst, _ = _case(seed)
    plan = page_descriptors(sb, db, 4096, src, dst)
    naive = _naive_pages(sb, db, 4096, src, dst)
    assert plan.count == len(naive) and plan.total_bytes == 4096 * len(naive)
    assert [tuple(r) for r in plan.local.tolist()] == [n[0] for n in naive]
    assert [tuple(r) for r in plan.remote.tolist()] == [n[1] for n in naive]


@pytest.mark.parametrize("seed", SEEDS)
def test_run_descriptors_match_naive(seed: int) -> None:
    """Run-merged descriptors equal a naive run-length merge on both sides."""
    sb, db, src, dst, _ = _case(seed)
    pb = np.arange(1, sb.size + 1) * 256  # per-region page bytes (K and V head dims may differ)
    plan = run_descriptors(sb, db, pb, src, dst, src_dev=1, dst_dev=2)
    runs = _naive_runs(src, dst)
    want_l = [(s0 + s * p, n * p, 1) for s0, p in zip(sb, pb, strict=True) for s, _, n in runs]
    want_r = [(d0 + d * p, n * p, 2) for d0, p in zip(db, pb, strict=True) for _, d, n in runs]
    assert [tuple(r) for r in plan.local.tolist()] == want_l
    assert [tuple(r) for r in plan.remote.tolist()] == want_r
    assert plan.total_bytes == int(pb.sum()) * src.size
    s0, d0, n = page_runs(src, dst)
    assert [list(x) for x in zip(s0.tolist(), d0.tolist(), n.tolist(), strict=True)] == runs


@pytest.mark.parametrize("seed", SEEDS)
def test_prepped_indices_address_the_same_bytes(seed: int) -> None:
    """Indices into prepped_rows lists select exactly the per-page descriptors."""
    sb, db, src, dst, pages = _case(seed)
    idx = prepped_indices(sb.size, src, dst, pages, pages, 4096)
    plan = page_descriptors(sb, db, 4096, src, dst)
    lgeo, rgeo = (
        ListGeometry.of(prepped_rows(sb, 4096, pages)),
        ListGeometry.of(prepped_rows(db, 4096, pages)),
    )
    assert lgeo.count == sb.size * pages and idx.local_idx.dtype == np.int32
    np.testing.assert_array_equal(lgeo.select(idx.local_idx.astype(np.int64)), plan.local)
    np.testing.assert_array_equal(rgeo.select(idx.remote_idx.astype(np.int64)), plan.remote)
    assert idx.total_bytes == plan.total_bytes


def test_geometry_accepts_nx3_rows() -> None:
    """(N, 3) rows are one element each; spans cover strided rows end to end."""
    geo = ListGeometry.of(np.array([[100, 10, 0], [500, 20, 1]]))
    assert geo.count == 2
    np.testing.assert_array_equal(geo.select(np.array([1, 0])), [[500, 20, 1], [100, 10, 0]])
    strided = ListGeometry.of(np.array([[1000, 8, 0, 16, 4]]))
    np.testing.assert_array_equal(strided.spans(), [[1000, 1000 + 3 * 16 + 8]])


@pytest.mark.parametrize(
    "call",
    [
        lambda: page_descriptors(np.array([1]), np.array([1]), 8, np.array([0, 1]), np.array([0])),
        lambda: page_descriptors(np.array([1]), np.array([1, 2]), 8, np.array([0]), np.array([0])),
        lambda: prepped_indices(1, np.array([5]), np.array([0]), 5, 5),
        lambda: prepped_indices(1, np.array([-1]), np.array([0]), 5, 5),
        lambda: prepped_rows(np.array([1]), 0, 5),
        lambda: ListGeometry.of(np.zeros((2, 4), dtype=np.int64)),
        lambda: choose_path(10, 10, "carrier-pigeon"),
    ],
)
def test_bad_input_is_invalid_argument(call: Callable[[], object]) -> None:
    """Malformed inputs raise InvalidArgument."""
    with pytest.raises(InvalidArgument):
        call()


def test_choose_path_follows_measured_regimes() -> None:
    """GPUs pack 65,536 x 32 KiB; CPU DRAM sends 32 KiB pages direct but packs 256 B slices."""
    assert choose_path(65_536, 2 << 30, "nixl-vram") == "packed"
    assert choose_path(8_192, 8_192 * 32 * 1024, "nixl-dram") == "direct"
    assert choose_path(8_192, 8_192 * 256, "nixl-dram") == "packed"
    assert choose_path(1, 1 << 30, "nixl-vram") == "direct"


def test_fit_calibration_recovers_per_descriptor_cost() -> None:
    """fit_calibration turns one-vs-many timings into the per-descriptor overhead."""
    cal = fit_calibration(0.1, 0.1 + 8191 * 10e-6, 8192, 1 << 28, 0.05)
    assert cal.per_desc_s == pytest.approx(10e-6)
    assert cal.copy_bps == pytest.approx((1 << 28) / 0.05)
    assert set(CALIBRATIONS) >= {"nixl-dram", "nixl-vram", "loopback"}
