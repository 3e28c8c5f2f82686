"""The lane's booking (Python's half after a copy the native thread made and told both engines
about) against the ways a transfer ends early: an Abort or a session's close that meets it, its
deadline passing before the completion is read, and a service stop. None may wait on the booking
while the booking waits on it (a CI teardown hung on that), and a stop never hangs."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.lane import Engines
from tests.support.poll import eventually
from tests.support.services import ServerThread, make_config


@pytest.fixture
def eng(make_server: Any) -> Iterator[Engines]:
    e = Engines(make_server(transport="loopback"), timeout=5.0)
    yield e
    e.close()


def _lane_transfer(eng: Engines, tid: str, src: int, dst: int, **expect: Any) -> None:
    eng.kb.expect_delta(tid, eng.b, prefix_pages=0, dst_page_indices=[dst], **expect)
    eng.ka.send_delta(tid, eng.a, src_page_indices=[src], peer_address=eng.peer)
    (r,) = eng.kb.wait(tid, timeout=10)
    assert r.state == "DONE" and r.route_note == "lane", r


def _booked(eng: Engines, tid: str) -> dict[str, str]:
    """Both sides' records of ``tid`` once Python booked them (terminal), by role."""
    table = eng.server.node.transfers.table

    def ended() -> dict[str, str] | None:
        recs = table.find(tid)
        if len(recs) == 2 and all(r.terminal for r in recs):
            return {r.role: r.state for r in recs}
        return None

    return eventually(ended, 10, f"{tid}: both sides booked")  # type: ignore[no-any-return]


def _hold_booking(eng: Engines, tid: str) -> tuple[threading.Event, Any]:
    """The lane's booking of ``tid`` stops before its plan until the returned release is called
    (the window in which CI's abort met it: the sender's record live, its worker not done)."""
    engine = eng.server.node.transfers
    loop = eng.server.loop
    held = threading.Event()
    gate = eng.server.call(_event())
    real = engine.dispatch.fetch_targets

    async def fetch_targets(out: Any) -> Any:
        if out.via_lane and out.rec.transfer_id == tid:
            held.set()
            await gate.wait()
        return await real(out)

    engine.dispatch.fetch_targets = fetch_targets
    return held, lambda: loop.call_soon_threadsafe(gate.set)


async def _event() -> asyncio.Event:
    return asyncio.Event()


@pytest.mark.parametrize("how", ["abort", "close_session"])
def test_an_end_that_meets_the_lane_booking_waits_for_it(eng: Engines, how: str) -> None:
    """The sender's engine aborts (or its session closes) while Python books the lane's copy: the
    copy is made and both engines heard DONE, so the end waits for the booking (both records
    DONE) instead of stopping it. Stopped, the booking's worker told the receiver, whose settle
    waited for the booking, which waited for that worker: nothing ended, and the stop hung."""
    book = eng.lane.book
    _lane_transfer(eng, "warm", 1, 2)  # this service has handshaken with itself
    eventually(lambda: book.sent == 1, 10, "warm-up booked")
    held, release = _hold_booking(eng, "held")
    _lane_transfer(eng, "held", 8, 4)
    assert held.wait(10), "the booking did not start"
    engine = eng.server.node.transfers
    if how == "abort":
        ended = asyncio.run_coroutine_threadsafe(
            engine.abort(eng.ka.session_id, "held", "ABORTED", "aborted by the engine"), eng.server.loop
        )
    else:  # what CloseSession does first
        ended = asyncio.run_coroutine_threadsafe(engine.release_session(eng.ka.session_id), eng.server.loop)
    time.sleep(0.2)  # the end meets the held booking
    assert not ended.done(), "the end did not wait for the booking"
    release()
    ended.result(timeout=10)
    assert _booked(eng, "held") == {"SENDER": "DONE", "RECEIVER": "DONE"}
    assert book.sent == 2 and book.n.armed_count() == 0
    assert eng.pages(eng.pb, [4]) == eng.pages(eng.pa, [8])
    eventually(lambda: not engine.table.live(), 5, "nothing live")


def test_a_booking_read_after_the_deadline_still_ends(eng: Engines) -> None:
    """The lane copied in time, but the completion is read after the deadline (a busy loop): the
    booking is not refused for the deadline (the engines heard DONE) and both sides end."""
    book = eng.lane.book
    _lane_transfer(eng, "warm", 1, 2)
    eventually(lambda: book.sent == 1, 10, "warm-up booked")
    eng.kb.expect_delta("late", eng.b, prefix_pages=0, dst_page_indices=[5], deadline_ms=300)
    eng.server.loop.call_soon_threadsafe(time.sleep, 0.6)  # the loop reads the completion late
    eng.ka.send_delta("late", eng.a, src_page_indices=[9], peer_address=eng.peer)
    (r,) = eng.kb.wait("late", timeout=10)
    assert r.state == "DONE" and r.route_note == "lane", r
    assert _booked(eng, "late") == {"SENDER": "DONE", "RECEIVER": "DONE"}
    eventually(lambda: book.n.armed_count() == 0, 5, "the armed entry forgotten after its booking")
    eventually(lambda: not eng.server.node.transfers.table.live(), 5, "nothing live")


def test_stop_right_after_the_lane_end_never_hangs() -> None:
    """CI's teardown: the receiver's DONE came over the lane, then the engines close and the
    service stops while the booking may still run; in a loop, with its timing moved about."""
    for i in range(8):
        server = ServerThread(make_config(transport="loopback"))
        eng = Engines(server, timeout=5.0)
        stopped = False
        try:
            _lane_transfer(eng, "warm", 1, 2)
            if i % 2:
                eng.server.loop.call_soon_threadsafe(time.sleep, 0.05 * i)  # the completion read later
            _lane_transfer(eng, "bad", 8, 4)
            t0 = time.monotonic()
            eng.close()
            server.stop()
            stopped = True
            assert time.monotonic() - t0 < 15
        finally:
            if not stopped:
                eng.close()


def test_a_settle_that_never_returns_cannot_hang_the_stop(caplog: Any) -> None:
    """Whatever does not settle at shutdown (here a lane settle that never returns), the stop
    goes on after the shutdown bound and says which transfers did not settle."""
    server = ServerThread(make_config(transport="loopback"))
    eng = Engines(server)
    try:
        eng.kb.expect_delta("stuck", eng.b, prefix_pages=0, dst_page_indices=[3])
        never: asyncio.Future[None] = server.call(_future())

        async def settle(inc: Any, code: str = "", reason: str = "") -> None:
            await asyncio.shield(never)

        eng.lane.book.settle = settle
        server.node.shutdown_settle_s = 1.0
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvservice"):
            server.stop()
        assert time.monotonic() - t0 < 10
        assert any(
            "did not settle" in r.getMessage() and "stuck" in r.getMessage() for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
    finally:
        eng.close()


async def _future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()
