"""What the scheduler side hands the worker side each step (pickled into the worker processes)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .jobs import AbortJob, ClaimJob, LandJob, RecvJob, SendJob, StreamChunk, StreamEnd

__all__ = [
    "AbortJob", "ClaimJob", "KVServiceMeta", "LandJob", "RecvJob", "SendJob", "StreamChunk", "StreamEnd",
]  # fmt: skip


@dataclasses.dataclass
class KVServiceMeta(KVConnectorMetadata):
    sends: list[SendJob] = dataclasses.field(default_factory=list)
    recvs: list[RecvJob] = dataclasses.field(default_factory=list)
    aborts: list[AbortJob] = dataclasses.field(default_factory=list)
    lands: list[LandJob] = dataclasses.field(default_factory=list)
    claims: list[ClaimJob] = dataclasses.field(default_factory=list)
    chunks: list[StreamChunk] = dataclasses.field(default_factory=list)  # sent layer by layer
    stream_ends: list[StreamEnd] = dataclasses.field(default_factory=list)
