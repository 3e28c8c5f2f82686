"""Routes: how one chunk's bytes reach one receiver rank, then its commit (DESIGN "Data path v3").

    same_node.py   FUSED: the receiver's pools are mapped here (this service, or a same-host
                   service's pools opened through their handles): one copy kernel, one commit
    packed.py      PACKED: batches packed into staging, written into the receiver's staging
                   (or packed straight into it on this service), unpacked there at commit
    direct.py      DIRECT: page descriptors written straight into the receiver's pages

Each route gets the chunk's ``ChunkMap`` (plan.py) and the receiver's ``ReceiverPort``
(port.py); none asks where the receiver lives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ...buffers import BufferSet
from ...errors import FailedPrecondition
from ...kernels import KVRegions
from ...staging import StagingPool
from ..port import ReceiverPort
from ..records import TransferTable
from ..sender import Outgoing
from ..transport import Transport
from ..values import Commit, Reserved, Target

__all__ = ["RouteContext", "commit"]


@dataclasses.dataclass(frozen=True)
class RouteContext:
    """What a route may touch on the sending service."""

    table: TransferTable
    transport: Transport
    kv_regions: dict[str, KVRegions]  # buffer set id -> its KV regions
    local_lists: dict[str, Any]  # buffer set id -> its prepped local descriptor list
    pool_for: Callable[[BufferSet], StagingPool]  # the staging pool of a buffer set's memory
    two_gpu_copy: str = "auto"  # Config.tuning.two_gpu_copy


async def commit(
    ctx: RouteContext,
    port: ReceiverPort,
    out: Outgoing,
    target: Target,
    seq: int,
    c: Commit,
    slot: Reserved | None = None,
) -> None:
    """Commit to the receiver, then count it on the sender's record. Never for bytes read from
    a pool whose memory its owner shrank meanwhile (guard.py): the transfer fails instead."""
    why = out.bs.lost()
    if why:
        raise FailedPrecondition(why)
    await port.commit(out, target, seq, c, slot)
    ctx.table.update(
        out.rec,
        add_bytes_sent=c.nbytes,
        add_descriptors=c.descriptors,
        add_pack=c.pack_us,
        add_wire=c.wire_us,
    )
