"""The client's book of ended transfer sides (``_transfer_stream.Ended``): what a Transfers
stream break does to it. An end already in the book stays the transfer's end; a side whose end
may have been lost in the break sends its waiter to a watch (None)."""

from __future__ import annotations

import dataclasses
import time

import pytest
from kvservice_client._transfer_stream import Ended
from kvservice_client._types import TransferStatus


def status(tid: str, role: str, bs: str, state: str = "DONE") -> TransferStatus:
    return dataclasses.replace(TransferStatus.queued(tid, role, bs, "FUSED"), state=state)


def soon() -> float:
    return time.monotonic() + 0.2


def test_an_end_in_the_book_survives_a_break() -> None:
    """The lane's END arrived, then the stream broke (its service stopped): the wait still has it."""
    book = Ended()
    book.made("t", "RECEIVER", "b")
    book.ended(status("t", "RECEIVER", "b"))
    book.forget_all()
    got = book.wait_all("t", soon())
    assert got is not None and [g.state for g in got] == ["DONE"]


def test_a_side_without_its_end_at_a_break_is_watched() -> None:
    """Its end may have been lost in the break: the waiter watches (None), it does not block."""
    book = Ended()
    book.made("t", "RECEIVER", "b")
    book.forget_all()
    assert book.wait_all("t", soon()) is None


def test_a_side_made_after_the_break_waits_for_its_end() -> None:
    book = Ended()
    book.forget_all()
    book.made("t", "SENDER", "a")
    with pytest.raises(TimeoutError):
        book.wait_all("t", time.monotonic() + 0.05)
    book.ended(status("t", "SENDER", "a", "FAILED"))
    got = book.wait_all("t", soon())
    assert got is not None and got[0].state == "FAILED"


def test_an_end_that_came_before_its_side_was_made_counts() -> None:
    """A fast END (a lane copy of microseconds) can reach the book before the call that made its
    side returned and said so: it is that side's end."""
    book = Ended()
    book.ended(status("t", "RECEIVER", "b"))
    book.made("t", "RECEIVER", "b")
    got = book.wait_all("t", soon())
    assert got is not None and got[0].state == "DONE"


def test_a_side_made_by_a_unary_call_is_watched() -> None:
    book = Ended()
    book.made("t", "RECEIVER", "b")
    book.ended(status("t", "RECEIVER", "b"))
    book.unsure("t")
    assert book.wait_all("t", soon()) is None


def test_a_lane_end_builds_the_same_status_as_the_dataclass() -> None:
    """``_status`` builds through ``TransferStatus.of_fields`` (no per-field setattr): every
    field, equal to the dataclass's own constructor, still frozen."""
    from kvservice_client import _lane, lane_wire

    st = _lane._status(lane_wire.End((0, True, "t", "b", "", 64, 1, 2, 7, 0)))
    ref = TransferStatus(
        "t", "RECEIVER", "b", "DONE", 64, 1, 2, 0, 1, 1, "FUSED", {"wire": 7, "total": 7}, "", "",
        st.updated_unix_ms, "lane",
    )  # fmt: skip
    assert st == ref and set(vars(st)) == {f.name for f in dataclasses.fields(TransferStatus)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.state = "FAILED"  # type: ignore[misc]
