"""Claim: copy a LANDED transfer out of the landing pool into the claimer's pages, then DONE.

::

    landing view pages 0 .. n-1 ──copy_pages (one fused launch / one compiled loop)──▶ dst pages
                                  same device: the landing lives where the engine's pool lives
    landing aux rows 0 .. r-1   ──row copy (host memory)───────────────────────────▶ ClaimRequest.aux rows

Checks come first and change nothing (a bad claim leaves the landing as it was). A claim of a
transfer still arriving waits for LANDED, bounded by ``wait_ms`` and the transfer's deadline. The
declaration is held ``busy`` during the copy, so an Abort racing the claim returns only after the
copy ended, and the bytes are freed only then (``LandingBook._ended``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...buffers import BufferSet
from ...errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument, KVServiceError
from ...kernels import KVRegions, _fused_cpu
from ...kernels.fused import copy_pages, fused_nbytes
from ...kernels.streams import run_on_device
from ..plan import src_pages_array
from ..receiver import Incoming
from ..records import Record
from ..requests import check_aux
from .book import Entry, LandingBook

if TYPE_CHECKING:
    from ..engine import TransferEngine

__all__ = ["claim"]

INLINE_BYTES = 2 << 20  # host copies up to this size run on the loop (see transfer.same_node)


async def claim(
    book: LandingBook,
    session_id: str,
    transfer_id: str,
    buffer_set_id: str,
    dst_page_indices: Sequence[int],
    wait_ms: int,
    aux: dict[str, np.ndarray] | None = None,
) -> tuple[Record, int]:
    """Claim ``transfer_id`` into pages ``dst_page_indices`` of ``buffer_set_id`` (the caller's),
    and its landed aux rows into rows ``aux`` (name -> rows, one entry per landed aux region);
    returns the DONE record and the microseconds spent once the pages had landed."""
    e = book.e
    if not transfer_id:
        raise InvalidArgument("transfer_id", "is required")
    bs = e.buffers.get(buffer_set_id, session_id)
    entry = book.find(transfer_id, bs.buffer_set_id)
    inc = entry.inc
    dst = src_pages_array(dst_page_indices, bs.layout.num_pages, "dst_page_indices")
    if dst.size != entry.pages:
        raise InvalidArgument(
            "dst_page_indices", f"{dst.size} pages for the {entry.pages} pages transfer {transfer_id!r} lands"
        )
    if inc.publish_hashes is not None and np.intersect1d(inc.prefix_page_indices, dst).size:
        raise InvalidArgument("dst_page_indices", "overlap the declaration's prefix_page_indices")
    aux = _aux_rows(bs, inc.aux, aux or {}, transfer_id)
    if entry.claiming:
        raise FailedPrecondition(f"transfer_id: {transfer_id!r} is being claimed by another call")
    await _until_landed(entry, wait_ms)
    if entry.claiming:  # another claim started while this one waited
        raise FailedPrecondition(f"transfer_id: {transfer_id!r} is being claimed by another call")
    t0 = time.monotonic()
    entry.claiming = True
    if entry.timer is not None:
        entry.timer.cancel()
    inc.enter()  # from here an Abort waits for the copy, and the bytes stay until it ended
    try:
        await _copy(entry.mem.regions, e.kv_regions[bs.buffer_set_id], dst)
        _copy_aux(entry.mem.bs, bs, aux)
    except KVServiceError as exc:
        inc.leave()
        await e.fail_incoming(inc, exc)
        raise
    except BaseException:
        inc.leave()
        raise
    inc.leave()
    if inc.rec.terminal:  # aborted (or the owner went) during the copy
        raise Aborted(f"transfer {transfer_id!r} is {inc.rec.state}: {inc.rec.error}")
    us = int((time.monotonic() - t0) * 1e6)
    e.table.update(inc.rec, add_unpack=us)
    lost = bs.lost()  # the engine shrank its memory during the copy
    if lost:
        book.release(entry)
        e.table.finish(inc.rec, "FAILED", "FAILED_PRECONDITION", lost)
        raise FailedPrecondition(lost)
    e.table.finish(inc.rec, "DONE")
    book.release(entry)  # the bytes are free when the claim returns
    book.count(entry.mem.arena.kind, "claims")
    book.claim_us.append(us)
    del book.claim_us[:-1024]
    _publish(e, inc, dst)
    return inc.rec.snapshot(), us


def _aux_rows(
    bs: BufferSet, landed: dict[str, np.ndarray], aux: dict[str, np.ndarray], transfer_id: str
) -> dict[str, np.ndarray]:
    """The claim's destination rows, checked against what landed (names, counts) and ``bs``."""
    check_aux(bs, aux)
    for name, rows in aux.items():
        have = landed.get(name)
        if have is None:
            raise InvalidArgument(f"aux[{name}]", f"transfer {transfer_id!r} landed no rows of {name!r}")
        if rows.size != have.size:
            raise InvalidArgument(
                f"aux[{name}].rows",
                f"{rows.size} rows for the {have.size} rows transfer {transfer_id!r} lands",
            )
    missing = sorted(set(landed) - set(aux))
    if missing:
        raise InvalidArgument(
            "aux", f"name the destination rows of every aux region transfer {transfer_id!r} lands: {missing}"
        )
    return aux


def _copy_aux(src_bs: BufferSet, dst_bs: BufferSet, aux: dict[str, np.ndarray]) -> None:
    """Landed rows ``0..r-1`` of each aux region into the claimer's rows (host memory, a few rows)."""
    for name, rows in aux.items():
        src, dst = src_bs.aux_by_name(name), dst_bs.aux_by_name(name)
        assert src is not None and dst is not None  # NOTE: both names checked (_aux_rows, check_aux)
        d = dst.region.pages(dst.row_bytes)
        d[torch.from_numpy(rows)] = src.region.pages(src.row_bytes)[: rows.size].to(d.device)


async def _until_landed(entry: Entry, wait_ms: int) -> None:
    rec = entry.inc.rec
    if rec.state == "LANDED":
        return
    left = rec.deadline - time.monotonic()
    if wait_ms:
        left = min(left, wait_ms / 1000)
    try:
        await asyncio.wait_for(entry.settled.wait(), max(left, 0.0))
    except asyncio.TimeoutError:
        raise DeadlineExceeded(
            f"transfer {rec.transfer_id!r} has not landed yet ({rec.state}, {rec.bytes_sent} of "
            f"{rec.expected_bytes} bytes) within the claim's wait"
        ) from None
    if rec.state != "LANDED":
        entry.book.find(rec.transfer_id, rec.buffer_set_id)  # raises what became of it


async def _copy(src: KVRegions, dst: KVRegions, dst_pages: np.ndarray) -> int:
    """One fused copy of every landed page into ``dst_pages``; never blocks the loop."""
    sp = np.arange(dst_pages.size, dtype=np.int64)
    if src.device.type == "cuda":
        return int(await run_on_device(src.device, "copy", lambda: copy_pages(src, dst, sp, dst_pages)))
    if fused_nbytes(src, int(sp.size), src.num_heads) <= INLINE_BYTES and _fused_cpu.ready():
        return copy_pages(src, dst, sp, dst_pages)
    return int(await asyncio.to_thread(copy_pages, src, dst, sp, dst_pages))


def _publish(e: TransferEngine, inc: Incoming, dst: np.ndarray) -> None:
    """After DONE: the claimed sequence's pages go into the index, as a DONE ExpectDelta's would."""
    if inc.publish_hashes is None:
        return
    pages = np.concatenate([inc.prefix_page_indices, dst])[: inc.publish_hashes.size]
    try:
        e.index.publish(inc.rec.buffer_set_id, inc.publish_hashes, pages, 0, tokens=inc.publish_tokens)
    except KVServiceError:
        pass  # NOTE: the copy is done; an index refusal (buffer set gone) does not undo it
