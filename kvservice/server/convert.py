"""protobuf <-> domain conversions for the servicers (the only place that does them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
from kvservice_client import Layout
from kvservice_client.proto import common_pb2, kvservice_pb2

from ..buffers import BufferSet
from ..errors import InvalidArgument
from ..index import IndexStats, Match
from ..staging import StagingStats
from ..tier import TierStats
from ..transfer.landing import LandedMatch, LandingStats
from ..transfer.load import Load
from ..transfer.records import Record

if TYPE_CHECKING:
    from ..transfer.engine import TransferEngine

__all__ = [
    "STATE_PB",
    "buffer_set_info",
    "layout",
    "metadata_value",
    "session_of",
    "token_ids",
    "transfer_status",
]


def layout(pb: common_pb2.Layout, field: str = "layout") -> Layout:
    if not pb.ByteSize() and field:
        raise InvalidArgument(field, "is required")
    return Layout.from_proto(pb)


def token_ids(pb: common_pb2.TokenIds, field: str) -> np.ndarray:
    """Packed u32-LE token ids as a uint32 array (zero-copy view of the message bytes)."""
    if len(pb.u32le) % 4:
        raise InvalidArgument(f"{field}.u32le", f"length {len(pb.u32le)} is not a multiple of 4")
    return np.frombuffer(pb.u32le, dtype="<u4")


def session_of(context: object) -> str | None:
    return metadata_value(context, "kvservice-session")


def metadata_value(context: object, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():  # type: ignore[attr-defined]
        if key == name:
            return str(value)
    return None


def buffer_set_info(bs: BufferSet, indexed_pages: int) -> kvservice_pb2.BufferSetInfo:
    return kvservice_pb2.BufferSetInfo(
        buffer_set_id=bs.buffer_set_id,
        engine_id=bs.engine_id,
        layout=bs.layout.to_proto(),
        memory=bs.memory,
        total_bytes=bs.total_bytes,
        indexed_pages=indexed_pages,
        session_id=bs.session_id,
    )


STATE_PB = {
    s: getattr(common_pb2, f"TRANSFER_STATE_{s}")
    for s in ("PENDING", "TRANSFERRING", "DONE", "FAILED", "ABORTED", "LANDED")
}
_ROLE = {"SENDER": kvservice_pb2.TRANSFER_ROLE_SENDER, "RECEIVER": kvservice_pb2.TRANSFER_ROLE_RECEIVER}
_PATH = {
    "AUTO": common_pb2.TRANSFER_PATH_AUTO,
    "DIRECT": common_pb2.TRANSFER_PATH_DIRECT,
    "PACKED": common_pb2.TRANSFER_PATH_PACKED,
    "FUSED": common_pb2.TRANSFER_PATH_FUSED,
}


def transfer_status(r: Record) -> kvservice_pb2.TransferStatus:
    t = r.timings_us
    return kvservice_pb2.TransferStatus(
        transfer_id=r.transfer_id,
        role=_ROLE[r.role],
        buffer_set_id=r.buffer_set_id,
        state=STATE_PB[r.state],
        bytes_sent=r.bytes_sent,
        pages_sent=r.pages_sent,
        pages_skipped=r.pages_skipped,
        descriptors=r.descriptors,
        chunks_done=r.chunks_done,
        senders_done=r.senders_done,
        path=_PATH[r.path],
        timings=kvservice_pb2.PhaseTimings(
            queue_us=t["queue"],
            plan_us=t["plan"],
            pack_us=t["pack"],
            wire_us=t["wire"],
            unpack_us=t["unpack"],
            total_us=r.total_us,
        ),
        error_code=r.error_code,
        error=r.error,
        updated_unix_ms=r.updated_unix_ms,
        route_note=r.route_note,
    )


def path_name(value: int, field: str = "path") -> str:
    for name, v in _PATH.items():
        if v == value:
            return name
    raise InvalidArgument(field, f"unknown TransferPath {value}")


def aux_rows(items: Iterable[common_pb2.AuxRows]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i, a in enumerate(items):
        if a.name in out:
            raise InvalidArgument(f"aux[{i}].name", f"duplicate aux name {a.name!r}")
        out[a.name] = np.asarray(a.rows, dtype=np.int64)
    return out


def landing_aux(items: Iterable[kvservice_pb2.LandingAux]) -> dict[str, int]:
    """``Landing.aux``: rows to land per aux region name."""
    out: dict[str, int] = {}
    for i, a in enumerate(items):
        if a.name in out:
            raise InvalidArgument(f"landing.aux[{i}].name", f"duplicate aux name {a.name!r}")
        out[a.name] = int(a.num_rows)
    return out


def key(request: object, tokens_field: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(tokens, hashes) of a request's ``key`` oneof; both None when unset."""
    which = request.WhichOneof("key")  # type: ignore[attr-defined]
    if which == "tokens":
        return token_ids(request.tokens, tokens_field), None  # type: ignore[attr-defined]
    if which == "hashes":
        return None, np.asarray(request.hashes.hashes, dtype=np.uint64)  # type: ignore[attr-defined]
    return None, None


def prefix_match(m: Match, load: Load, landed: LandedMatch | None = None) -> kvservice_pb2.PrefixMatch:
    return kvservice_pb2.PrefixMatch(
        landed_pages=landed.pages if landed is not None else 0,
        landed_transfer_id=landed.transfer_id if landed is not None else "",
        buffer_set_id=m.buffer_set_id,
        engine_id=m.engine_id,
        tp_rank=m.tp_rank,
        dp_rank=m.dp_rank,
        matched_pages=m.matched_pages,
        page_indices=m.page_indices.tolist(),
        min_priority=m.min_priority,
        load=transfer_load(load),
    )


def transfer_load(ld: Load) -> kvservice_pb2.TransferLoad:
    return kvservice_pb2.TransferLoad(
        inbound_transfers=ld.inbound_transfers,
        inbound_bytes_pending=ld.inbound_bytes_pending,
        outbound_transfers=ld.outbound_transfers,
        staging_waiters=ld.staging_waiters,
        inbound_p50_us=ld.inbound_p50_us,
        inbound_p99_us=ld.inbound_p99_us,
        inbound_samples=ld.inbound_samples,
        inbound_max_transfers=ld.budget.max_transfers,
        inbound_max_bytes=ld.budget.max_bytes,
        inbound_refused=ld.inbound_refused,
        admits=ld.admits,
        landed_transfers=ld.landed_transfers,
        landed_bytes=ld.landed_bytes,
    )


def landing_stats(st: LandingStats) -> kvservice_pb2.LandingStats:
    return kvservice_pb2.LandingStats(**dataclasses.asdict(st))


def index_stats(st: IndexStats) -> kvservice_pb2.IndexStats:
    return kvservice_pb2.IndexStats(
        entries=st.entries,
        leases=st.leases,
        lookups=st.lookups,
        hit_pages=st.hit_pages,
        query_pages=st.query_pages,
        entries_by_priority=st.entries_by_priority,
    )


def staging_stats(st: StagingStats) -> kvservice_pb2.StagingStats:
    return kvservice_pb2.StagingStats(
        kind=st.kind,
        capacity_bytes=st.capacity_bytes,
        used_bytes=st.used_bytes,
        slots_in_use=st.slots_in_use,
        waiters=st.waiters,
    )


def transfer_counts(e: TransferEngine) -> kvservice_pb2.TransferCounts:
    counts = e.table.counts
    return kvservice_pb2.TransferCounts(
        in_flight=e.in_flight(),
        done=counts["DONE"],
        failed=counts["FAILED"],
        aborted=counts["ABORTED"],
        queue_depth={k: v for k, v in e.sender.queue_depth.items() if v},
    )


def tier_stats(st: TierStats) -> kvservice_pb2.TierStats:
    return kvservice_pb2.TierStats(
        capacity_bytes=st.capacity_bytes,
        used_bytes=st.used_bytes,
        held_pages=st.held_pages,
        layouts=st.layouts,
        hit_pages=st.hits,
        miss_pages=st.misses,
        evicted_pages=st.evictions,
        stored_pages=st.stored_pages,
        stored_bytes=st.stored_bytes,
        duplicate_pages=st.duplicate_pages,
        loaded_pages=st.loaded_pages,
        fill_backlog_pages=st.fill_backlog_pages,
    )
