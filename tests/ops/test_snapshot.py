"""kvservice.ops.snapshot: live records by phase, peers read defensively, session rows."""

from __future__ import annotations

import types

from kvservice.ops import PeerRtts, in_flight, peer_states, session_rows
from kvservice.ops.snapshot import phase_of
from kvservice.sessions import Session


def _rec(role: str, state: str = "TRANSFERRING", nbytes: int = 0, **timings: int):
    return types.SimpleNamespace(role=role, state=state, bytes_sent=nbytes, timings_us=timings)


def test_a_sender_is_in_the_phase_after_its_last_timed_one() -> None:
    """queue+plan timed -> pack; nothing timed -> queue; unpack stays unpack."""
    assert phase_of(_rec("SENDER", queue=5, plan=2)) == ("sender", "pack")
    assert phase_of(_rec("SENDER", "PENDING")) == ("sender", "queue")
    assert phase_of(_rec("SENDER", wire=3, unpack=1)) == ("sender", "unpack")


def test_a_receiver_is_declared_until_bytes_arrive() -> None:
    """PENDING without bytes: declared; anything else: receiving."""
    assert phase_of(_rec("RECEIVER", "PENDING")) == ("receiver", "declared")
    assert phase_of(_rec("RECEIVER", "PENDING", nbytes=64)) == ("receiver", "receiving")


def test_in_flight_groups_and_sums_bytes() -> None:
    """Records group by (role, phase) with their bytes summed, sorted."""
    groups = in_flight(
        [_rec("SENDER", nbytes=10, queue=1), _rec("SENDER", nbytes=5, queue=1), _rec("RECEIVER", "PENDING")]
    )
    assert [(g.role, g.phase, g.transfers, g.bytes) for g in groups] == [
        ("receiver", "declared", 1, 0),
        ("sender", "plan", 2, 15),
    ]


def test_peers_of_an_engine_without_them_read_as_none() -> None:
    """A transfer engine shaped differently (no peers attribute) gives no rows, not an error."""
    assert peer_states(object(), PeerRtts()) == []


def test_peer_rows_from_a_directory_and_channels() -> None:
    """Address, service id, stream open, queue depth and the last RTT come through."""
    peer = types.SimpleNamespace(service_id="svc-b", is_self=False)
    engine = types.SimpleNamespace(
        peers=types.SimpleNamespace(_peers={"b:1": peer}),
        dispatch=types.SimpleNamespace(channels={"b:1": types.SimpleNamespace(_call=object())}),
        sender=types.SimpleNamespace(queue_depth={"b:1": 2}),
    )
    rtts = PeerRtts()
    rtts.last["b:1"] = 120
    (row,) = peer_states(engine, rtts)
    assert (row.address, row.service_id, row.channel_state, row.stream_open, row.rtt_us, row.queue_depth) == (
        "b:1",
        "svc-b",
        "",
        True,
        120,
        2,
    )


def test_session_rows_count_buffer_sets_and_transfers() -> None:
    """Each session gets its buffer sets and live transfers; rows sort by client name."""
    a, b = Session("aaaa", "zeta", 1), Session("bbbb", "alpha", 2)
    rows = session_rows([(a, True), (b, False)], ["aaaa", "aaaa", "bbbb"], {"bbbb": 3})
    assert [(r.session.client_name, r.attached, r.buffer_sets, r.transfers_in_flight) for r in rows] == [
        ("alpha", False, 1, 3),
        ("zeta", True, 2, 0),
    ]
