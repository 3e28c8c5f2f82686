"""What the scheduler side hands the worker side each step (pickled into the worker processes)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["AbortJob", "KVServiceMeta", "RecvJob", "SendJob"]


@dataclasses.dataclass(frozen=True)
class SendJob:
    """Prefill side: a finished request's prompt pages go to the decode instance's service."""

    req_id: str
    transfer_id: str
    pages: tuple[int, ...]  # this instance's block ids, prompt order (the receiver skips its prefix)
    peer: str  # the decode instance's kvservice (host:port)
    deadline_ms: int


@dataclasses.dataclass(frozen=True)
class RecvJob:
    """Decode side: the blocks past the local prefix-cache hit wait for the prefill's pages."""

    req_id: str
    transfer_id: str
    prefix_pages: int  # pages this instance holds already (its prefix-cache hit): not sent
    pages: tuple[int, ...]  # this instance's block ids for the pages that move
    deadline_ms: int


@dataclasses.dataclass(frozen=True)
class AbortJob:
    """Decode side: a request ended while its pages were on their way; stop every write first."""

    req_id: str
    transfer_id: str
    reason: str


@dataclasses.dataclass
class KVServiceMeta(KVConnectorMetadata):
    sends: list[SendJob] = dataclasses.field(default_factory=list)
    recvs: list[RecvJob] = dataclasses.field(default_factory=list)
    aborts: list[AbortJob] = dataclasses.field(default_factory=list)
