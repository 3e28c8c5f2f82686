"""End-to-end integrity of a transfer's bytes (``transfer_integrity``; docs/design/security.md).

When a receiver declares with integrity on, its plan says so (``ReceivePlan.integrity``) and
every commit that carries positions must carry a checksum of the chunk's bytes as packed for
that receiver rank (kernels/checksum.py)::

    sender                                      receiver
    pack batch ─▶ checksum ──WRITE, commit──▶   checksum(its slot) ─▶ verdict ─▶ unpack gated on it
    direct/fused write ─▶ checksum(pack(src)) ─commit─▶ checksum(pack(dst pages)) == ? ─▶ count

Neither side waits for a checksum on its own: on CUDA each is launched on the stream of the work
it belongs to and read when that work's completion (the event the caller already awaits) fires::

    sender, "pack" stream:     pack ─▶ wsum64 ─▶ slot ─▶ host        [event] ─▶ value ─▶ WRITE
    receiver, "unpack" stream: wsum64 ─▶ verdict(== sender's) ─▶ unpack(gate=verdict) [event]
                                                                      ─▶ verdict read: DONE / FAILED

NOTE: the receiver still verifies BEFORE it unpacks: the unpack kernel reads the verdict on the
device and, when it is 0, masks off every load and store, so a corrupted batch never reaches the
engine's pages, with no host round trip between the checksum and the unpack. A host algorithm
(``xxh3``: CPU pools, or a host sender's batch in VRAM) hashes in a worker thread and the unpack
then runs only if it matched, in the same step.

A mismatch or a missing checksum fails the transfer (FAILED_PRECONDITION naming the batch);
nothing is unpacked, and nothing counts towards DONE.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import kernels
from ..errors import FailedPrecondition
from ..kernels import checksum
from ..kernels.checksum import Pending
from ..kernels.streams import on_side_stream, run_on_device

if TYPE_CHECKING:
    from .values import Plan, Target

__all__ = ["Check", "landed_check", "pack_hashed", "pages_check", "unpack_verified"]

Check = tuple[int, str]  # (checksum, checksum_kind)


async def pack_hashed(
    plan: Plan,
    target: Target,
    regions: kernels.KVRegions,
    src: np.ndarray,
    view: torch.Tensor | None,
    *,
    backend: checksum.Backend = "auto",
) -> Check | None:
    """Pack ``src`` for ``target`` into ``view`` (exactly the packed bytes; None: a temporary)
    and, when the plan asks for integrity, checksum the packed bytes right behind the pack on the
    same stream; returns once both are done, with the sender's check (None without integrity).
    ``backend="triton"``: the Triton ``wsum64`` even on host bytes (the interpreter, tests)."""
    device = regions.device if view is None else view.device
    kind = "wsum64" if backend == "triton" or device.type == "cuda" else "xxh3"

    def launch() -> Pending | None:
        packed = target.pack(regions, src, view).reshape(-1)
        return checksum.launch(packed, kind, backend=backend) if plan.integrity else None

    pending = await run_on_device(device, "pack", launch)
    return None if pending is None else (pending.value(), kind)


async def pages_check(
    plan: Plan, regions: kernels.KVRegions, src: np.ndarray, target: Target
) -> Check | None:
    """The sender's checksum of a direct or fused chunk: its pages packed for the receiver rank."""
    if not plan.integrity or not src.size:
        return None
    return await pack_hashed(plan, target, regions, src, None)


async def unpack_verified(
    regions: kernels.KVRegions,
    view: torch.Tensor,
    pages: np.ndarray,
    check: Check | None,
    what: str,
    *,
    backend: checksum.Backend = "auto",
    **unpack_kw: Any,
) -> None:
    """Unpack the packed ``view`` into ``pages`` (``kernels.unpack``'s keywords) only if it hashes
    to ``check``; else raise FailedPrecondition naming ``what``, no page changed. Returns once the
    unpack is done (or refused)."""
    value, kind = _expected(check, what)

    def launch() -> Pending:
        pending = checksum.launch(view, kind, expect=value, backend=backend)
        kernels.unpack(regions, view, pages, gate=pending.gate, backend=backend, **unpack_kw)
        return pending

    if not (await _run(view.device, checksum.on_device(view.device, kind, backend), launch)).matches():
        raise _mismatch(what)


async def landed_check(
    regions: kernels.KVRegions, pages: np.ndarray, check: Check | None, what: str, **pack_kw: Any
) -> None:
    """Raise FailedPrecondition naming ``what`` unless ``pages`` (``kernels.pack``'s keywords:
    packed as the sender packed them) hash to ``check``: the receiver's proof that a direct or
    fused write reached them."""
    value, kind = _expected(check, what)

    def launch() -> Pending:
        packed = kernels.pack(regions, pages, **pack_kw).reshape(-1)
        return checksum.launch(packed, kind, expect=value)

    if not (await _run(regions.device, checksum.on_device(regions.device, kind), launch)).matches():
        raise _mismatch(what)


async def _run(device: torch.device, enqueued: bool, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (the receiver's launches) and return its result once its work is done: on the
    "unpack" service stream when the checksum is ``enqueued`` there (or the bytes are on the
    host: a worker thread), else (a host hash of VRAM bytes, which waits for their copy to the
    host) in a worker thread on a side stream, never on the loop."""
    if device.type == "cuda" and not enqueued:
        return await asyncio.to_thread(on_side_stream, device, fn)
    return await run_on_device(device, "unpack", fn)


def _expected(check: Check | None, what: str) -> Check:
    if check is None:
        raise FailedPrecondition(f"checksum: the {what} carries none; this receiver requires integrity")
    return check


def _mismatch(what: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"checksum: the {what} does not match what the sender sent (corrupted or unwritten)"
    )
