"""kvservice.ops.activity: the recent-transfers window behind GetStats.activity."""

from __future__ import annotations

import types

from kvservice.ops.activity import MAX_WINDOW_S, RecentTransfers


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _rec(state: str = "DONE", path: str = "FUSED", role: str = "SENDER", nbytes: int = 100, us: int = 1000):
    return types.SimpleNamespace(role=role, path=path, state=state, bytes_sent=nbytes, total_us=us)


def test_the_window_counts_only_recent_transfers_and_totals_count_all() -> None:
    """Transfers older than the window leave the counts but stay in the totals."""
    clock = Clock()
    recent = RecentTransfers(clock)
    recent.observe(_rec(nbytes=10))
    clock.t += 20
    recent.observe(_rec(nbytes=30))
    (w,) = recent.window(10.0)
    assert (w.role, w.route, w.done, w.bytes, w.done_total, w.bytes_total) == (
        "sender",
        "fused",
        1,
        30,
        2,
        40,
    )


def test_percentiles_are_over_done_transfers_only() -> None:
    """p50/p99 come from DONE transfers; failed ones are counted apart."""
    recent = RecentTransfers(Clock())
    for us in range(1, 101):
        recent.observe(_rec(us=us * 10))
    recent.observe(_rec(state="FAILED", us=10**9))
    (w,) = recent.window()
    assert (w.done, w.failed) == (100, 1)
    assert 500 <= w.p50_us <= 510 and 980 <= w.p99_us <= 1000


def test_one_entry_per_role_and_route_sorted() -> None:
    """Routes and roles are kept apart and listed in a stable order."""
    recent = RecentTransfers(Clock())
    for role, path in (("SENDER", "PACKED"), ("RECEIVER", "FUSED"), ("SENDER", "DIRECT")):
        recent.observe(_rec(role=role, path=path))
    assert [(w.role, w.route) for w in recent.window()] == [
        ("receiver", "fused"),
        ("sender", "direct"),
        ("sender", "packed"),
    ]


def test_window_is_clamped_to_uptime_and_maximum() -> None:
    """The covered window never exceeds the uptime nor MAX_WINDOW_S."""
    clock = Clock()
    recent = RecentTransfers(clock)
    clock.t += 3
    assert recent.window_s(10) == 3
    clock.t += 10_000
    assert recent.window_s(10**6) == MAX_WINDOW_S


def test_a_broken_record_is_logged_not_raised() -> None:
    """observe never raises (it runs inside the transfer table's terminal listeners)."""
    recent = RecentTransfers(Clock())
    recent.observe(object())
    assert recent.window() == []
