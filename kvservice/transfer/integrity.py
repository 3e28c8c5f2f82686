"""End-to-end integrity of a transfer's bytes (issue 33, ``transfer_integrity``).

When a receiver declares with integrity on, its plan says so (``ReceivePlan.integrity``) and
every commit that carries positions must carry a checksum of the chunk's bytes as packed for
that receiver rank (kernels/checksum.py)::

    sender                                   receiver
    pack batch ─▶ checksum(staging) ──commit──▶ checksum(its staging slot) == ? ─▶ unpack
    direct/fused write ─▶ checksum(pack(src pages)) ─commit─▶ checksum(pack(dst pages)) == ? ─▶ count

A mismatch or a missing checksum fails the transfer (FAILED_PRECONDITION naming the batch);
nothing counts towards DONE.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..errors import FailedPrecondition
from ..kernels.checksum import checksum, default_kind
from ..kernels.streams import on_side_stream

__all__ = ["Check", "pages_check", "staged_check", "verify"]

Check = tuple[int, str]  # (checksum, checksum_kind)


async def verify(data: Any, check: Check | None, what: str) -> None:
    """Raise FailedPrecondition unless ``data`` (1-D uint8) hashes to ``check``."""
    if check is None:
        raise FailedPrecondition(f"checksum: the {what} carries none; this receiver requires integrity")
    value, kind = check
    got = await asyncio.to_thread(lambda: on_side_stream(data.device, lambda: checksum(data, kind)))
    if got != value:
        raise FailedPrecondition(
            f"checksum: the {what} does not match what the sender sent (corrupted or unwritten)"
        )


async def staged_check(plan: Any, view: Any) -> Check | None:
    """The sender's checksum of one packed batch (None unless the plan asks for integrity)."""
    if not plan.integrity:
        return None
    kind = default_kind(view)
    return await asyncio.to_thread(lambda: on_side_stream(view.device, lambda: checksum(view, kind))), kind


async def pages_check(plan: Any, regions: Any, src: np.ndarray, target: Any) -> Check | None:
    """The sender's checksum of a direct or fused chunk: its pages packed for the receiver rank."""
    if not plan.integrity or not src.size:
        return None

    def run() -> Check:
        packed = target.pack(regions, src).reshape(-1)
        return checksum(packed, default_kind(packed)), default_kind(packed)

    return await asyncio.to_thread(lambda: on_side_stream(regions.device, run))
