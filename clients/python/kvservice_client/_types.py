"""Typed results returned by the clients (immutable; converted from protobuf at one place)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

from ._proto import common_pb2, kvservice_pb2

__all__ = [
    "EvictionSuggestion",
    "MatchResult",
    "PrefixMatch",
    "RegisteredBuffers",
    "TransferLoad",
    "TransferStatus",
]

State = Literal["PENDING", "TRANSFERRING", "LANDED", "DONE", "FAILED", "ABORTED", "UNSPECIFIED"]
TERMINAL = frozenset({"DONE", "FAILED", "ABORTED"})


@dataclasses.dataclass(frozen=True)
class RegisteredBuffers:
    buffer_set_id: str
    page_bytes_k: int
    page_bytes_v: int


@dataclasses.dataclass(frozen=True)
class TransferLoad:
    """Transfer load of one buffer set (an engine rank): can it take a transfer now?"""

    inbound_transfers: int = 0
    inbound_bytes_pending: int = 0
    outbound_transfers: int = 0
    staging_waiters: int = 0
    inbound_p50_us: int = 0
    inbound_p99_us: int = 0
    inbound_samples: int = 0
    inbound_max_transfers: int = 0  # 0: unlimited
    inbound_max_bytes: int = 0  # 0: unlimited
    inbound_refused: int = 0
    admits: bool = True
    landed_transfers: int = 0  # LANDED in the landing pool, waiting for a claim (not inbound)
    landed_bytes: int = 0

    @property
    def transfers_free(self) -> int | None:
        """Inbound transfers it can still take (None: unlimited)."""
        if not self.inbound_max_transfers:
            return None
        return max(self.inbound_max_transfers - self.inbound_transfers, 0)

    @classmethod
    def from_proto(cls, pb: kvservice_pb2.TransferLoad) -> TransferLoad:
        return cls(**{f.name: getattr(pb, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    buffer_set_id: str
    engine_id: str
    tp_rank: int
    dp_rank: int
    matched_pages: int
    page_indices: tuple[int, ...]
    min_priority: int
    load: TransferLoad = TransferLoad()
    landed_pages: int = 0  # leading pages claimable from a LANDED transfer (prefix included)
    landed_transfer_id: str = ""
    tier_pages: int = 0  # leading pages of the prompt the node's host tier holds (LoadPages restores them)


@dataclasses.dataclass(frozen=True)
class Offloaded:
    """What an OffloadPages kept in the node's host tier."""

    stored_pages: int  # copied into the tier
    already_held: int  # the tier held them already (not copied again)
    not_stored: int  # not kept: the tier is off, or its arena had no slot that was not leased

    @classmethod
    def from_proto(cls, pb: kvservice_pb2.OffloadPagesResponse) -> Offloaded:
        return cls(pb.stored_pages, pb.already_held, pb.not_stored)


@dataclasses.dataclass(frozen=True)
class EvictionSuggestion:
    """Pages to evict first, in order, with their priority and whether another engine holds them."""

    page_indices: tuple[int, ...]
    priorities: tuple[int, ...]
    duplicated: tuple[bool, ...]

    @classmethod
    def from_proto(cls, pb: kvservice_pb2.SuggestEvictionsResponse) -> EvictionSuggestion:
        return cls(tuple(pb.page_indices), tuple(pb.priorities), tuple(pb.duplicated))


@dataclasses.dataclass(frozen=True)
class MatchResult:
    matches: tuple[PrefixMatch, ...]
    query_pages: int
    lease_id: str
    lease_expires_unix_ms: int

    @property
    def best(self) -> PrefixMatch | None:
        return self.matches[0] if self.matches else None

    @classmethod
    def from_proto(cls, pb: kvservice_pb2.MatchPrefixResponse) -> MatchResult:
        return cls(
            matches=tuple(
                PrefixMatch(
                    buffer_set_id=m.buffer_set_id,
                    engine_id=m.engine_id,
                    tp_rank=m.tp_rank,
                    dp_rank=m.dp_rank,
                    matched_pages=m.matched_pages,
                    page_indices=tuple(m.page_indices),
                    min_priority=m.min_priority,
                    load=TransferLoad.from_proto(m.load),
                    landed_pages=m.landed_pages,
                    landed_transfer_id=m.landed_transfer_id,
                    tier_pages=m.tier_pages,
                )
                for m in pb.matches
            ),
            query_pages=pb.query_pages,
            lease_id=pb.lease_id,
            lease_expires_unix_ms=pb.lease_expires_unix_ms,
        )


@dataclasses.dataclass(frozen=True)
class TransferStatus:
    transfer_id: str
    role: Literal["SENDER", "RECEIVER", "UNSPECIFIED"]
    buffer_set_id: str
    state: State
    bytes_sent: int
    pages_sent: int
    pages_skipped: int
    descriptors: int
    chunks_done: int
    senders_done: int
    path: str
    timings_us: dict[str, int]
    error_code: str
    error: str
    updated_unix_ms: int
    route_note: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @classmethod
    def of_fields(cls, fields: dict[str, Any]) -> TransferStatus:
        """From every field by name, without the frozen dataclass's per-field ``__setattr__``
        (~4 µs less a status: the lane's END, on the waiting engine's path)."""
        st = object.__new__(cls)
        object.__setattr__(st, "__dict__", fields)
        return st

    @classmethod
    def queued(cls, transfer_id: str, role: str, buffer_set_id: str, path: str) -> TransferStatus:
        """A side just handed to the service (the lane's answer has no more to say)."""
        return cls(
            transfer_id, role, buffer_set_id, "TRANSFERRING", 0, 0, 0, 0, 0, 0, path, {}, "", "",  # type: ignore[arg-type]
            int(time.time() * 1000),
        )  # fmt: skip

    @classmethod
    def from_proto(cls, pb: kvservice_pb2.TransferStatus) -> TransferStatus:
        t = pb.timings
        return cls(
            transfer_id=pb.transfer_id,
            role=kvservice_pb2.TransferRole.Name(pb.role).removeprefix("TRANSFER_ROLE_"),  # type: ignore[arg-type]
            buffer_set_id=pb.buffer_set_id,
            state=common_pb2.TransferState.Name(pb.state).removeprefix("TRANSFER_STATE_"),  # type: ignore[arg-type]
            bytes_sent=pb.bytes_sent,
            pages_sent=pb.pages_sent,
            pages_skipped=pb.pages_skipped,
            descriptors=pb.descriptors,
            chunks_done=pb.chunks_done,
            senders_done=pb.senders_done,
            path=common_pb2.TransferPath.Name(pb.path).removeprefix("TRANSFER_PATH_"),
            timings_us={
                "queue": t.queue_us,
                "plan": t.plan_us,
                "pack": t.pack_us,
                "wire": t.wire_us,
                "unpack": t.unpack_us,
                "total": t.total_us,
            },
            error_code=pb.error_code,
            error=pb.error,
            updated_unix_ms=pb.updated_unix_ms,
            route_note=pb.route_note,
        )
