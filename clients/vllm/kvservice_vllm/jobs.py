"""The jobs the scheduler side hands the worker side each step (plain values: no vLLM import, so
the worker side and its tests run without the engine package)."""

from __future__ import annotations

import dataclasses

__all__ = ["AbortJob", "RecvJob", "SendJob"]


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
