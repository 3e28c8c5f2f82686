"""Typed results returned by the clients (immutable; converted from protobuf at one place)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ._proto import common_pb2, kvservice_pb2

__all__ = ["MatchResult", "PrefixMatch", "RegisteredBuffers", "TransferStatus"]

State = Literal["PENDING", "TRANSFERRING", "DONE", "FAILED", "ABORTED", "UNSPECIFIED"]
TERMINAL = frozenset({"DONE", "FAILED", "ABORTED"})


@dataclasses.dataclass(frozen=True)
class RegisteredBuffers:
    buffer_set_id: str
    page_bytes_k: int
    page_bytes_v: int


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    buffer_set_id: str
    engine_id: str
    tp_rank: int
    dp_rank: int
    matched_pages: int
    page_indices: tuple[int, ...]
    min_priority: int


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
