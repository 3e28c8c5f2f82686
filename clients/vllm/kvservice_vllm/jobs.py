"""The jobs the scheduler side hands the worker side each step (plain values: no vLLM import, so
the worker side and its tests run without the engine package)."""

from __future__ import annotations

import dataclasses

__all__ = ["AbortJob", "ClaimJob", "LandJob", "RecvJob", "SendJob", "StreamChunk", "StreamEnd"]


@dataclasses.dataclass(frozen=True)
class SendJob:
    """Prefill side: a finished request's prompt pages go to the decode instance's service."""

    req_id: str
    transfer_id: str
    pages: tuple[int, ...]  # this instance's block ids, prompt order (the receiver skips its prefix)
    peer: str  # the decode instance's kvservice (host:port)
    deadline_ms: int
    layerwise: bool = False  # one transfer per layer (layers.py): PP, or the request asked


@dataclasses.dataclass(frozen=True)
class RecvJob:
    """Decode side: the blocks past the local prefix-cache hit wait for the prefill's pages."""

    req_id: str
    transfer_id: str
    prefix_pages: int  # pages this instance holds already (its prefix-cache hit): not sent
    pages: tuple[int, ...]  # this instance's block ids for the pages that move
    deadline_ms: int
    sender: str = ""  # the prefill's kvservice (ExpectDelta.sender_address); "": not known
    layerwise: bool = False  # one transfer per layer (layers.py), as the prefill streams them


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """Prefill side, layer-wise streaming: in this step, as each layer is computed, its pages
    ``chunk_offset .. chunk_offset + len(pages)`` of the prompt go as a chunk of that layer's
    transfer; ``last``: the step completes the prompt (its partial last page included)."""

    req_id: str
    transfer_id: str
    chunk_offset: int
    pages: tuple[int, ...]  # this instance's block ids of those pages
    last: bool
    peer: str
    deadline_ms: int


@dataclasses.dataclass(frozen=True)
class StreamEnd:
    """Prefill side: a streamed request finished. ``reason`` "": whole (report the send when every
    layer transfer ended); else it ended early (aborted, preempted): abort them, then report."""

    req_id: str
    transfer_id: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class LandJob:
    """Decode side, landing option: the request's blocks could not be allocated at once, so its
    pages land in the service's landing pool meanwhile (the prefill's pages are free at LANDED)."""

    req_id: str
    transfer_id: str
    prefix_pages: int  # the local prefix-cache hit when it was matched
    pages: int  # pages to land past it
    deadline_ms: int
    ttl_ms: int
    sender: str = ""  # as RecvJob.sender


@dataclasses.dataclass(frozen=True)
class ClaimJob:
    """Decode side, landing option: the blocks are allocated now; claim the landed pages into
    them (or, if the landing was refused, receive them as a RecvJob would)."""

    req_id: str
    transfer_id: str
    prefix_pages: int  # as landed
    pages: tuple[int, ...]  # this instance's block ids for the landed pages
    deadline_ms: int
    why_not: str = ""  # non-empty: the allocation no longer matches the landing (the load fails)
    sender: str = ""  # as RecvJob.sender (a refused landing is received directly from it)


@dataclasses.dataclass(frozen=True)
class AbortJob:
    """Decode side: a request ended while its pages were on their way; stop every write first."""

    req_id: str
    transfer_id: str
    reason: str
