"""GetStats: the operator view of the node as one ``GetStatsResponse``, scoped to its viewer.

What a viewer sees (kvservice.ops.access decides who is an admin)::

    field                      admin            session (non-admin)       no session
    buffer_sets                all              its own                   none
    session_list               all              its own                   none
    peers                      all              none                      none
    index/staging/transfers,
    activity, in_flight        the node's counters, for everyone (no ids, no owners)
    scope_note                 ""               says what is scoped and how to see all
"""

from __future__ import annotations

from kvservice_client.proto import kvservice_pb2 as pb

from ..node import VERSION, Node
from ..ops import PeerRtts, RecentTransfers, Viewer, in_flight, peer_states, session_rows
from ..ops.activity import DEFAULT_WINDOW_S
from . import convert

__all__ = ["stats_response"]


def stats_response(
    node: Node, viewer: Viewer, activity: RecentTransfers, rtts: PeerRtts, window_ms: int = 0
) -> pb.GetStatsResponse:
    resp = pb.GetStatsResponse(
        service_id=node.service_id,
        version=VERSION,
        uptime_ms=node.uptime_ms,
        sessions=len(node.sessions),
        admin_view=viewer.admin,
    )
    all_sets = node.buffers.all()
    for bs in all_sets:
        if viewer.sees(bs.session_id):
            info = convert.buffer_set_info(bs, node.index.indexed_pages(bs.buffer_set_id))
            info.load.CopyFrom(convert.transfer_load(node.load_of(bs.buffer_set_id)))
            info.duplicated_pages = node.index.duplicated_pages(bs.buffer_set_id)
            resp.buffer_sets.append(info)
    resp.buffer_sets_total = len(all_sets)
    resp.scope_note = viewer.scope_note(len(all_sets), len(resp.buffer_sets))
    resp.index.CopyFrom(convert.index_stats(node.index.stats()))
    resp.tier.CopyFrom(convert.tier_stats(node.tier.tier.stats()))
    window_s = window_ms / 1000 if window_ms else DEFAULT_WINDOW_S
    resp.activity.window_ms = int(activity.window_s(window_s) * 1000)
    for w in activity.window(window_s):
        resp.activity.routes.append(pb.RouteActivity(**w.__dict__))
    engine = node.transfers
    for st in engine.memory.staging_stats():
        resp.staging.append(convert.staging_stats(st))
    for ls in engine.landing.stats():
        resp.landing.append(convert.landing_stats(ls))
    resp.transfers.CopyFrom(convert.transfer_counts(engine))
    for g in in_flight(engine.table.live()):
        resp.in_flight.append(pb.InFlight(role=g.role, phase=g.phase, transfers=g.transfers, bytes=g.bytes))
    live = dict(engine.table.live_per_session)
    if viewer.admin:
        for p in peer_states(engine, rtts):
            resp.peers.append(pb.PeerInfo(**p.__dict__))
    for row in session_rows(node.sessions.listing(), (b.session_id for b in all_sets), live):
        s = row.session
        if viewer.sees(s.session_id):
            resp.session_list.append(
                pb.SessionInfo(
                    client_name=s.client_name,
                    session_ref=s.session_id[:8],
                    attached=row.attached,
                    opened_unix_ms=s.opened_unix_ms,
                    uid=s.identity.uid if s.identity is not None else -1,
                    admin=s.admin,
                    buffer_sets=row.buffer_sets,
                    transfers_in_flight=row.transfers_in_flight,
                )
            )
    return resp
