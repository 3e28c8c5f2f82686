"""Protobuf ↔ domain values at the peer boundary: receive plans and commits.

Only this module, the peer channel (peer_channel.py), the two peer-facing halves
(peer_receiver.py: a sender's view of another service; peer_serving.py: this service answering
one) and server/ touch ``peer_pb2``; routes, the receiver and the plan math see ``port.Plan`` and
``port.Commit``.
"""

from __future__ import annotations

import numpy as np
from kvservice_client import Layout
from kvservice_client.proto import common_pb2, peer_pb2

from ..kernels.heads import HeadRoute
from .values import Commit, Plan, Region

__all__ = ["PATH_NAME", "commit_from_pb", "commit_to_pb", "plan_from_pb", "plan_to_pb"]

_PATH_PB = {
    "DIRECT": common_pb2.TRANSFER_PATH_DIRECT,
    "PACKED": common_pb2.TRANSFER_PATH_PACKED,
    "FUSED": common_pb2.TRANSFER_PATH_FUSED,
}
PATH_NAME = {v: k for k, v in _PATH_PB.items()}


def _region_pb(r: Region) -> peer_pb2.RemoteRegion:
    return peer_pb2.RemoteRegion(
        address=r.address, size_bytes=r.size, mem_kind=r.mem_kind, device_id=r.device
    )


def _region(r: peer_pb2.RemoteRegion) -> Region:
    return Region(r.address, r.size_bytes, r.mem_kind, r.device_id)


def plan_to_pb(p: Plan) -> peer_pb2.ReceivePlan:
    r = p.route
    return peer_pb2.ReceivePlan(
        sender_ticket=p.sender_ticket,
        integrity=p.integrity,
        transfer_id=p.transfer_id,
        dst_layout=p.dst_layout.to_proto(),
        prefix_pages=p.prefix_pages,
        dst_page_indices=p.dst_pages.tolist(),
        aux=[{"name": n, "rows": rows.tolist()} for n, rows in p.aux.items()],
        expected_senders=p.expected_senders,
        remaining_ms=p.remaining_ms,
        kv_regions=[_region_pb(x) for x in p.kv_regions],
        aux_regions=[_region_pb(x) for x in p.aux_regions],
        aux_row_bytes=list(p.aux_row_bytes),
        aux_names=list(p.aux_names),
        dst_buffer_set_id=p.dst_buffer_set_id,
        direct_ok=p.direct_ok,
        publishes=p.publishes,
        route=peer_pb2.HeadRoute(
            src_head_start=r.src_head_start, dst_head_start=r.dst_head_start, num_heads=r.num_heads
        ),
        kv_handles=list(p.kv_handles),
        same_host_refusal=p.same_host_refusal,
    )


def plan_from_pb(m: peer_pb2.ReceivePlan, src_tp_rank: int) -> Plan:
    """The plan a receiver sent to sender rank ``src_tp_rank``."""
    dst = Layout.from_proto(m.dst_layout)
    r = m.route
    return Plan(
        transfer_id=m.transfer_id,
        dst_buffer_set_id=m.dst_buffer_set_id,
        dst_layout=dst,
        prefix_pages=m.prefix_pages,
        dst_pages=np.asarray(m.dst_page_indices, dtype=np.int64),
        route=HeadRoute(src_tp_rank, dst.tp_rank, r.src_head_start, r.dst_head_start, r.num_heads),
        sender_ticket=m.sender_ticket,
        integrity=m.integrity,
        direct_ok=m.direct_ok,
        publishes=m.publishes,
        expected_senders=m.expected_senders,
        remaining_ms=m.remaining_ms,
        aux={a.name: np.asarray(a.rows, dtype=np.int64) for a in m.aux},
        kv_regions=tuple(_region(x) for x in m.kv_regions),
        aux_regions=tuple(_region(x) for x in m.aux_regions),
        aux_row_bytes=tuple(m.aux_row_bytes),
        aux_names=tuple(m.aux_names),
        kv_handles=tuple(m.kv_handles),
        same_host_refusal=m.same_host_refusal,
    )


def commit_to_pb(
    c: Commit, transfer_id: str, plan: Plan, sender_service_id: str, src: Layout, seq: int
) -> peer_pb2.CommitChunkRequest:
    """The commit of sender rank ``src`` (its layout rides along when the plan was offered: the
    receiver binds the rank at its first commit)."""
    return peer_pb2.CommitChunkRequest(
        src_layout=src.to_proto() if plan.offered else None,
        transfer_id=transfer_id,
        dst_buffer_set_id=plan.dst_buffer_set_id,
        sender_service_id=sender_service_id,
        src_tp_rank=src.tp_rank,
        chunk_seq=seq,
        last_chunk=c.last,
        path=_PATH_PB[c.path],
        staging_slot=c.slot_id,
        positions=c.positions.tolist(),
        bytes=c.nbytes,
        pages_skipped=c.skipped,
        descriptors=c.descriptors,
        pack_us=c.pack_us,
        wire_us=c.wire_us,
        aux_delivered=c.aux,
        dst_head_start=c.head_start,
        num_heads=c.num_heads,
        credit_slot=c.credit,
        sender_ticket=plan.sender_ticket,
        checksum=c.check[0] if c.check else 0,
        checksum_kind=c.check[1] if c.check else "",
    )


def commit_from_pb(req: peer_pb2.CommitChunkRequest) -> Commit:
    return Commit(
        positions=np.asarray(req.positions, dtype=np.int64),
        path=PATH_NAME.get(req.path, "DIRECT"),
        head_start=req.dst_head_start,
        num_heads=req.num_heads,
        nbytes=req.bytes,
        skipped=req.pages_skipped,
        descriptors=req.descriptors,
        slot_id=req.staging_slot,
        credit=req.credit_slot,
        aux=req.aux_delivered,
        last=req.last_chunk,
        pack_us=req.pack_us,
        wire_us=req.wire_us,
        check=(req.checksum, req.checksum_kind) if req.checksum_kind else None,
    )
