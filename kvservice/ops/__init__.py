"""The operator view: who may see the whole node, what it did recently, what it holds now.

``access`` decides whether a GetStats caller is an admin (no session needed), ``activity``
keeps the recent transfers (rates and latency per route), ``snapshot`` reads live state
(phases in flight, peers, sessions) into immutable values. The servicer converts them.
"""

from __future__ import annotations

from .access import AdminPolicy, Viewer
from .activity import RecentTransfers, RouteWindow
from .snapshot import InFlightGroup, PeerRtts, PeerState, SessionRow, in_flight, peer_states, session_rows

__all__ = [
    "AdminPolicy",
    "InFlightGroup",
    "PeerRtts",
    "PeerState",
    "RecentTransfers",
    "RouteWindow",
    "SessionRow",
    "Viewer",
    "in_flight",
    "peer_states",
    "session_rows",
]
