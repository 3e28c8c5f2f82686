"""Live state for the operator view, read into immutable rows: transfers in flight by phase,
peers (channel state, round trip), sessions.

NOTE: the transfer engine's peers and channels have no public listing yet, so this module is
the one place that reads them (``engine.peers``, ``engine.dispatch.channels``) and does so
defensively: a missing attribute reads as "unknown", never an error, so a reshaped
``transfer/`` degrades the view instead of failing GetStats.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..sessions import Session

if TYPE_CHECKING:
    from ..transfer.engine import TransferEngine
    from ..transfer.peers import PeerClient
    from ..transfer.records import Record

__all__ = ["InFlightGroup", "PeerRtts", "PeerState", "SessionRow", "in_flight", "peer_states", "session_rows"]

_SENDER_PHASES = ("queue", "plan", "pack", "wire", "unpack")
PROBE_TIMEOUT_S = 0.25


@dataclasses.dataclass(frozen=True)
class InFlightGroup:
    role: str  # "sender" | "receiver"
    phase: str  # receiver: "declared" | "receiving" | "landed"; sender: one of _SENDER_PHASES
    transfers: int
    bytes: int  # moved so far


@dataclasses.dataclass(frozen=True)
class PeerState:
    address: str
    service_id: str
    channel_state: str  # gRPC connectivity name, "" when unknown
    stream_open: bool
    is_self: bool
    rtt_us: int  # last measured, 0: never
    queue_depth: int


@dataclasses.dataclass(frozen=True)
class SessionRow:
    session: Session
    attached: bool
    buffer_sets: int
    transfers_in_flight: int


def phase_of(rec: Record) -> tuple[str, str]:
    """(role, phase) of a live record; a sender's phase is the one after the last that took
    time (its chunks cycle through them, so this is where it is, give or take a chunk)::

        timings_us: queue=12 plan=3 pack=40 wire=0 unpack=0   ->  "wire"
    """
    role = str(rec.role).lower()
    if role == "receiver":
        if rec.state == "LANDED":  # in the landing pool, waiting for a claim (kvservice.transfer.landing)
            return role, "landed"
        return role, "receiving" if rec.bytes_sent or rec.state == "TRANSFERRING" else "declared"
    timings = getattr(rec, "timings_us", {}) or {}
    last = max((i for i, p in enumerate(_SENDER_PHASES) if timings.get(p, 0) > 0), default=-1)
    return role, _SENDER_PHASES[min(last + 1, len(_SENDER_PHASES) - 1)]


def in_flight(records: Iterable[Record]) -> list[InFlightGroup]:
    """Live records grouped by (role, phase), sorted."""
    n: collections.Counter[tuple[str, str]] = collections.Counter()
    moved: collections.Counter[tuple[str, str]] = collections.Counter()
    for rec in records:
        key = phase_of(rec)
        n[key] += 1
        moved[key] += int(rec.bytes_sent)
    return [InFlightGroup(r, p, n[(r, p)], moved[(r, p)]) for r, p in sorted(n)]


def _peers(engine: TransferEngine) -> dict[str, PeerClient]:
    return dict(getattr(getattr(engine, "peers", None), "_peers", {}) or {})


def _channel_state(peer: PeerClient) -> str:
    chan = getattr(peer, "_channel", None)
    try:
        return str(chan.get_state(try_to_connect=False).name) if chan is not None else ""
    except Exception:  # a closed or foreign channel object: unknown, not an error
        return ""


def peer_states(engine: TransferEngine, rtts: PeerRtts) -> list[PeerState]:
    """Every peer the engine has a client for, sorted by address."""
    channels = getattr(getattr(engine, "dispatch", None), "channels", {}) or {}
    depth = dict(getattr(getattr(engine, "sender", None), "queue_depth", {}) or {})
    rows = []
    for address, peer in sorted(_peers(engine).items()):
        chan = channels.get(address)
        rows.append(
            PeerState(
                address=address,
                service_id=str(getattr(peer, "service_id", "") or ""),
                channel_state=_channel_state(peer),
                stream_open=chan is not None and getattr(chan, "_call", None) is not None,
                is_self=bool(getattr(peer, "is_self", False)),
                rtt_us=rtts.last.get(address, 0),
                queue_depth=max(int(depth.get(address, 0)), 0),
            )
        )
    return rows


class PeerRtts:
    """Round trips to peers, measured on demand with one health check over each peer's channel."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    async def probe(self, engine: TransferEngine) -> None:
        """Measure every peer at once, each bounded by PROBE_TIMEOUT_S (a timeout keeps the old value)."""

        async def one(address: str, peer: PeerClient) -> None:
            chan = getattr(peer, "_channel", None)
            if chan is None:
                return
            t0 = time.perf_counter()
            try:
                await health_pb2_grpc.HealthStub(chan).Check(
                    health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
                )
            except Exception:  # unreachable now: channel_state says so
                return
            self.last[address] = max(1, int((time.perf_counter() - t0) * 1e6))

        await asyncio.gather(*(one(a, p) for a, p in _peers(engine).items()))


def session_rows(
    listing: Iterable[tuple[Session, bool]], owners: Iterable[str], live: Mapping[str, int]
) -> list[SessionRow]:
    """Rows for ``listing`` (SessionRegistry.listing()); ``owners``: the session id of every
    buffer set; ``live``: unfinished transfers per session id (a mapping)."""
    owned = collections.Counter(owners)
    rows = [
        SessionRow(s, attached, owned[s.session_id], int(live.get(s.session_id, 0)))
        for s, attached in listing
    ]
    return sorted(rows, key=lambda r: (r.session.client_name, r.session.opened_unix_ms))
