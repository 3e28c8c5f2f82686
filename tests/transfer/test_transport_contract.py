"""Contract tests run against every Transport implementation (loopback double and NIXL)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvservice.errors import InvalidArgument, NotFound, TransportError
from kvservice.transfer.descriptors import prepped_indices, prepped_rows, run_descriptors
from kvservice.transfer.loopback import LoopbackTransport
from kvservice.transfer.nixl_transport import NIXL_IMPORT_ERROR, NixlTransport
from kvservice.transfer.transport import Transport
from tests.support.poll import eventually

REGIONS, PAGES, PAGE_BYTES = 4, 32, 512
_names = itertools.count()


@dataclass
class Pair:
    src: Transport
    dst: Transport
    src_buf: np.ndarray  # (REGIONS, PAGES * PAGE_BYTES) uint8
    dst_buf: np.ndarray

    def bases(self, buf: np.ndarray) -> np.ndarray:
        return buf.ctypes.data + np.arange(REGIONS, dtype=np.int64) * buf.shape[1]

    def page(self, buf: np.ndarray, region: int, page: int) -> np.ndarray:
        return buf[region, page * PAGE_BYTES : (page + 1) * PAGE_BYTES]


def _make(kind: str, name: str) -> Transport:
    if kind == "nixl":
        if NIXL_IMPORT_ERROR is not None:
            pytest.skip(f"nixl not importable: {NIXL_IMPORT_ERROR}")
        return NixlTransport(name)
    return LoopbackTransport(name)


@pytest.fixture(params=["loopback", "nixl"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    n = next(_names)
    src, dst = _make(request.param, f"src{n}"), _make(request.param, f"dst{n}")
    rng = np.random.default_rng(n)
    src_buf = rng.integers(0, 256, (REGIONS, PAGES * PAGE_BYTES), dtype=np.uint8)
    dst_buf = np.zeros_like(src_buf)
    src.register(src_buf.ctypes.data, src_buf.nbytes, "DRAM", 0)
    dst.register(dst_buf.ctypes.data, dst_buf.nbytes, "DRAM", 0)
    src.add_peer(dst.agent_name, dst.metadata())
    dst.add_peer(src.agent_name, src.metadata())
    yield Pair(src, dst, src_buf, dst_buf)
    src.close()
    dst.close()


def _drain(t: Transport, timeout_s: float = 5.0) -> dict[str, list[bytes]]:
    try:
        return eventually(t.notifications, timeout_s, "a notification", interval=0.001)  # type: ignore[no-any-return]
    except AssertionError:
        return {}


async def test_add_peer_returns_str_name(pair: Pair) -> None:
    """add_peer returns the peer name as str (NIXL itself returns bytes)."""
    assert pair.src.add_peer(pair.dst.agent_name, pair.dst.metadata()) == pair.dst.agent_name


async def test_add_peer_rejects_other_agents_metadata(pair: Pair) -> None:
    """Metadata naming a different agent raises TransportError."""
    with pytest.raises(TransportError):
        pair.src.add_peer("someone-else", pair.dst.metadata())


async def test_prepped_write_moves_scattered_pages(pair: Pair) -> None:
    """Strided prepped lists + index arrays move exactly the chosen pages of every region."""
    src_pages, dst_pages = np.array([1, 2, 3, 9, 30, 31]), np.array([0, 5, 6, 7, 20, 21])
    lst = pair.src.prep_local(prepped_rows(pair.bases(pair.src_buf), PAGE_BYTES, PAGES))
    rem = pair.src.prep_remote(pair.dst.agent_name, prepped_rows(pair.bases(pair.dst_buf), PAGE_BYTES, PAGES))
    plan = prepped_indices(REGIONS, src_pages, dst_pages, PAGES, PAGES, PAGE_BYTES)
    handle = pair.src.write(lst, plan.local_idx, rem, plan.remote_idx)
    assert handle.nbytes == plan.total_bytes == REGIONS * src_pages.size * PAGE_BYTES
    await pair.src.wait(handle, time.monotonic() + 10)
    expect = np.zeros_like(pair.dst_buf)
    for r in range(REGIONS):
        for s, d in zip(src_pages, dst_pages, strict=True):
            pair.page(expect, r, d)[:] = pair.page(pair.src_buf, r, s)
    np.testing.assert_array_equal(pair.dst_buf, expect)


async def test_write_descs_moves_merged_runs(pair: Pair) -> None:
    """Raw run descriptors from run_descriptors land byte-exact."""
    src_pages, dst_pages = np.array([4, 5, 6, 10, 11]), np.array([0, 1, 2, 8, 9])
    plan = run_descriptors(
        pair.bases(pair.src_buf), pair.bases(pair.dst_buf), PAGE_BYTES, src_pages, dst_pages
    )
    assert plan.count == 2 * REGIONS
    handle = pair.src.write_descs(pair.dst.agent_name, plan.local, plan.remote)
    await pair.src.wait(handle, time.monotonic() + 10)
    for r in range(REGIONS):
        np.testing.assert_array_equal(
            pair.dst_buf[r, : 3 * PAGE_BYTES], pair.src_buf[r, 4 * PAGE_BYTES : 7 * PAGE_BYTES]
        )
        np.testing.assert_array_equal(
            pair.dst_buf[r, 8 * PAGE_BYTES : 10 * PAGE_BYTES],
            pair.src_buf[r, 10 * PAGE_BYTES : 12 * PAGE_BYTES],
        )


async def test_notification_arrives_keyed_by_str_sender(pair: Pair) -> None:
    """A write's notif reaches the peer under the sender's str name, after the bytes."""
    lst = pair.src.prep_local(prepped_rows(pair.bases(pair.src_buf), PAGE_BYTES, PAGES))
    rem = pair.src.prep_remote(pair.dst.agent_name, prepped_rows(pair.bases(pair.dst_buf), PAGE_BYTES, PAGES))
    handle = pair.src.write(lst, np.array([3]), rem, np.array([4]), notif=b"T1:chunk0")
    await pair.src.wait(handle, time.monotonic() + 10)
    assert _drain(pair.dst) == {pair.src.agent_name: [b"T1:chunk0"]}
    np.testing.assert_array_equal(pair.page(pair.dst_buf, 0, 4), pair.page(pair.src_buf, 0, 3))


async def test_send_notif_without_transfer(pair: Pair) -> None:
    """send_notif delivers a standalone message."""
    pair.src.send_notif(pair.dst.agent_name, b"hello")
    assert _drain(pair.dst) == {pair.src.agent_name: [b"hello"]}


async def test_wait_releases_the_handle(pair: Pair) -> None:
    """After wait returns, the handle is released (status raises NotFound)."""
    lst = pair.src.prep_local(prepped_rows(pair.bases(pair.src_buf), PAGE_BYTES, PAGES))
    rem = pair.src.prep_remote(pair.dst.agent_name, prepped_rows(pair.bases(pair.dst_buf), PAGE_BYTES, PAGES))
    handle = pair.src.write(lst, np.array([0]), rem, np.array([0]))
    await pair.src.wait(handle, time.monotonic() + 10)
    with pytest.raises(NotFound):
        pair.src.status(handle)


async def test_bad_indices_are_invalid_argument(pair: Pair) -> None:
    """Out-of-range or unequal-length index arrays raise InvalidArgument and post nothing."""
    lst = pair.src.prep_local(prepped_rows(pair.bases(pair.src_buf), PAGE_BYTES, PAGES))
    rem = pair.src.prep_remote(pair.dst.agent_name, prepped_rows(pair.bases(pair.dst_buf), PAGE_BYTES, PAGES))
    with pytest.raises(InvalidArgument):
        pair.src.write(lst, np.array([REGIONS * PAGES]), rem, np.array([0]))
    with pytest.raises(InvalidArgument):
        pair.src.write(lst, np.array([0, 1]), rem, np.array([0]))
    assert not pair.dst_buf.any()


async def test_length_mismatch_is_invalid_argument(pair: Pair) -> None:
    """Elements of different lengths on the two sides raise InvalidArgument."""
    lst = pair.src.prep_local(prepped_rows(pair.bases(pair.src_buf), PAGE_BYTES, PAGES))
    rem = pair.src.prep_remote(
        pair.dst.agent_name, prepped_rows(pair.bases(pair.dst_buf), PAGE_BYTES // 2, PAGES)
    )
    with pytest.raises(InvalidArgument):
        pair.src.write(lst, np.array([0]), rem, np.array([0]))


async def test_unregistered_memory_is_transport_error(pair: Pair) -> None:
    """Descriptors outside the peer's registered memory raise TransportError."""
    other = np.zeros(1 << 16, dtype=np.uint8)
    with pytest.raises(TransportError):
        pair.src.prep_remote(pair.dst.agent_name, np.array([[other.ctypes.data, 4096, 0]]))


async def test_unknown_peer_and_handles_are_not_found(pair: Pair) -> None:
    """Unknown peers and registrations raise NotFound."""
    with pytest.raises(NotFound):
        pair.src.prep_remote("nobody", prepped_rows(pair.bases(pair.dst_buf), PAGE_BYTES, PAGES))
    reg = pair.src.register(pair.src_buf.ctypes.data, 4096, "DRAM", 0)
    pair.src.deregister(reg)
    with pytest.raises(NotFound):
        pair.src.deregister(reg)
