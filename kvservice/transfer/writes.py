"""Posting a transport WRITE and waiting for it without spinning (data path v3 §1).

post   on the loop for a few rows with NIXL (tens of µs, no byte copied: a thread hop costs
       more), else in a worker thread (a long list, or the loopback transport, which copies)
wait   a poller thread watches the handle, the loop sleeps; on abort or deadline the handle
       is settled first, so no byte lands after the sender answers
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..errors import DeadlineExceeded, TransportError
from .sender import Outgoing, check_live
from .transport import Transport, XferHandle

__all__ = ["INLINE_POST_ROWS", "post_write", "wait_write"]

INLINE_POST_ROWS = 64  # WRITEs of at most this many rows are posted on the loop


async def post_write(transport: Transport, peer_agent: str, local: np.ndarray, *rest: Any) -> XferHandle:
    """Post a WRITE of ``local``'s descriptor rows to ``peer_agent`` (``rest``: as write_descs)."""
    if transport.kind == "nixl" and len(local) <= INLINE_POST_ROWS:
        return transport.write_descs(peer_agent, local, *rest)
    return await asyncio.to_thread(transport.write_descs, peer_agent, local, *rest)


async def wait_write(transport: Transport, out: Outgoing, h: XferHandle) -> None:
    """Wait for ``h``; on ``out``'s stop or deadline settle it first, then raise."""
    state = await transport.poll_until(h, out.rec.deadline, lambda: bool(out.stop))
    if state == "PROC":
        await transport.settle(h)
        check_live(out)
        raise DeadlineExceeded("transfer deadline passed")
    transport.release(h)
    if state == "ERR":
        raise TransportError(f"write to {out.peer_address} failed")
