"""kvservice_sglang's landing option (``SGLANG_KVSERVICE_LANDING_TTL_MS``), driven in the order
SGLang's prefill and decode schedulers call the backend, over two in-process services (loopback,
the cross-node route). SGLang's base classes come from the real package when it is installed,
else from a stand-in (sglang_stub), so this runs on a machine without SGLang; with
``KVS_SGLANG_REAL=1`` the real package is required (tests/adapters/test_sglang_backend.py runs this
module so in .venv-vllm, where the pinned sglang 0.5.23 is).

Pools are SGLang-shaped (per-layer K and V buffers, two metadata buffers of per-request rows) in
POSIX shared memory, registered through the backend's own code.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "sglang"))
from tests.support import sglang_stub
from tests.support.poll import eventually
from tests.support.sglang_pools import AUX, ITEM, LAYERS, PAGES, Pools, manager

TTL_MS = "20000"


@pytest.fixture(scope="module")
def conn() -> Any:
    """kvservice_sglang.conn over the real SGLang, or over the stand-in (removed afterwards)."""
    with sglang_stub.backend_conn() as c:
        yield c


@pytest.fixture
def node(conn, monkeypatch, make_server):  # type: ignore[no-untyped-def]
    """A prefill and a decode instance on two services, the decode with the landing option."""
    sp = make_server(transport="loopback", same_host_route="off")
    sd = make_server(transport="loopback", same_host_route="off")
    p, d = Pools(1), Pools(2)
    server = conn.KVServiceBootstrapServer("127.0.0.1", 0)
    mp = manager(conn, monkeypatch, sp, "prefill", p, SGLANG_KVSERVICE_BOOTSTRAP_TIMEOUT_S="10")
    md = manager(conn, monkeypatch, sd, "decode", d, SGLANG_KVSERVICE_LANDING_TTL_MS=TTL_MS)
    yield {"mp": mp, "md": md, "p": p, "d": d, "sd": sd, "addr": f"127.0.0.1:{server.port}", "conn": conn}
    mp.close()
    md.close()
    server.close()
    p.close()
    d.close()


def receiver_record(node: Any, room: int) -> Any:
    recs = node["sd"].app.node.transfers.table.find(f"sgl-{room}", "RECEIVER")
    return recs[-1] if recs else None


def landing_used(node: Any) -> int:
    return sum(a.used_bytes for a in node["sd"].app.node.transfers.landing.pool.arenas.values())


def pair(node: Any, room: int) -> tuple[Any, Any]:
    c = node["conn"]
    return c.KVServiceReceiver(node["md"], node["addr"], room), c.KVServiceSender(
        node["mp"], node["addr"], room
    )


def prefill_sends(node: Any, send: Any, src: np.ndarray, aux_index: int) -> None:
    """The prefill, as SGLang runs it once the room is there: init, then two chunks."""
    poll = node["conn"].KVPoll
    eventually(lambda: send.poll() == poll.WaitingForInput)
    assert send.pop_decode_prefix_len() == 0
    send.init(src.size, aux_index=aux_index)
    send.send(src[:3])
    send.send(src[3:])  # the last chunk carries the aux rows


def check_bytes(
    node: Any, before: list[np.ndarray], src: np.ndarray, dst: np.ndarray, rows: tuple[int, int]
) -> None:
    """The prefill's pages in ``dst`` and its aux row in the decode's row; nothing else changed."""
    after, p = node["d"].snapshot(), node["p"]
    untouched = np.setdiff1d(np.arange(PAGES), dst)
    for i, buf in enumerate(p.bufs):
        np.testing.assert_array_equal(after[i][dst], buf[src])
        np.testing.assert_array_equal(after[i][untouched], before[i][untouched])
    src_row, dst_row = rows
    for j, x in enumerate(p.aux):
        got, was = after[len(p.bufs) + j], before[len(p.bufs) + j]
        np.testing.assert_array_equal(got[dst_row], x[src_row])
        assert np.array_equal(np.delete(got, dst_row, 0), np.delete(was, dst_row, 0))


def test_the_prefill_lands_before_the_decode_allocates_and_the_allocation_claims(node) -> None:
    """init posts the room at once; the prefill sends and is done (LANDED) with no decode page
    allocated; send_metadata then claims pages and metadata rows into the allocation."""
    poll = node["conn"].KVPoll
    room, src, dst = 11, np.arange(10, 16), np.array([50, 41, 33, 60, 2, 9])
    recv, send = pair(node, room)
    before = node["d"].snapshot()
    assert send.poll() == poll.Bootstrapping
    recv.init(0)
    prefill_sends(node, send, src, aux_index=5)
    eventually(lambda: send.poll() in (poll.Success, poll.Failed))
    assert send.poll() == poll.Success, send.failed  # the prefill's pages are free: it landed
    rec = receiver_record(node, room)
    assert rec.landing and rec.state == "LANDED", rec
    assert recv.poll() == poll.WaitingForInput  # SGLang still waits to allocate
    assert landing_used(node) > 0
    for i, snap in enumerate(node["d"].snapshot()):
        np.testing.assert_array_equal(snap, before[i])  # nothing in the decode's pools yet
    recv.send_metadata(dst, aux_index=2, decode_prefix_len=0)
    eventually(lambda: recv.poll() in (poll.Success, poll.Failed))
    assert recv.poll() == poll.Success, recv.failed
    assert receiver_record(node, room).state == "DONE" and landing_used(node) == 0
    check_bytes(node, before, src, dst, (5, 2))
    assert recv.get_transfer_metric().transfer_total_bytes == src.size * ITEM * 2 * LAYERS + sum(
        r for r, _ in AUX
    )


def test_an_allocation_at_once_takes_the_default_path(node) -> None:
    """send_metadata before the prefill's page count arrives: an ordinary ExpectDelta, no landing."""
    poll = node["conn"].KVPoll
    room, src, dst = 12, np.arange(20, 26), np.array([1, 2, 3, 4, 5, 6])
    recv, send = pair(node, room)
    before = node["d"].snapshot()
    recv.init(0)
    recv.send_metadata(dst, aux_index=7, decode_prefix_len=0)
    prefill_sends(node, send, src, aux_index=1)
    eventually(
        lambda: recv.poll() in (poll.Success, poll.Failed) and send.poll() in (poll.Success, poll.Failed)
    )
    assert (recv.poll(), send.poll()) == (poll.Success, poll.Success), (recv.failed, send.failed)
    assert not receiver_record(node, room).landing
    assert node["sd"].app.node.transfers.landing.pool.arenas == {}  # no landing was ever declared
    check_bytes(node, before, src, dst, (1, 7))


def test_a_refused_landing_is_received_directly(node) -> None:
    """The landing pool cannot hold it: no landing, the prefill waits, send_metadata receives directly."""
    poll = node["conn"].KVPoll
    room, src, dst = 13, np.arange(30, 36), np.array([8, 9, 10, 11, 12, 13])
    node["sd"].app.node.transfers.landing.pool.capacity_bytes = 4096  # less than the 6 pages
    recv, send = pair(node, room)
    before = node["d"].snapshot()
    recv.init(0)
    prefill_sends(node, send, src, aux_index=3)
    eventually(lambda: recv._landing.done())
    assert recv._landing.result() is None
    (ls,) = node["sd"].app.node.transfers.landing.stats()
    assert ls.refused == 1 and ls.used_bytes == 0, ls
    assert send.poll() == poll.Transferring  # its pages wait for the decode's allocation
    recv.send_metadata(dst, aux_index=4, decode_prefix_len=0)
    eventually(
        lambda: recv.poll() in (poll.Success, poll.Failed) and send.poll() in (poll.Success, poll.Failed)
    )
    assert (recv.poll(), send.poll()) == (poll.Success, poll.Success), (recv.failed, send.failed)
    assert not receiver_record(node, room).landing
    check_bytes(node, before, src, dst, (3, 4))


def test_a_request_dropped_before_its_allocation_frees_its_landing(node) -> None:
    """SGLang clears a request that ends in the pre-allocation queue: the landing is aborted, freed."""
    poll = node["conn"].KVPoll
    room = 14
    recv, send = pair(node, room)
    before = node["d"].snapshot()
    recv.init(0)
    prefill_sends(node, send, np.arange(40, 46), aux_index=0)
    eventually(lambda: send.poll() == poll.Success)
    assert receiver_record(node, room).state == "LANDED"
    recv.clear()
    eventually(lambda: receiver_record(node, room).state == "ABORTED")
    eventually(lambda: landing_used(node) == 0)
    assert recv.poll() == poll.Failed
    for i, snap in enumerate(node["d"].snapshot()):
        np.testing.assert_array_equal(snap, before[i])


def test_the_option_is_off_by_default_and_where_it_cannot_work(conn, monkeypatch, make_server) -> None:
    """Off unless set; ignored on a prefill instance, with the decode radix cache, with state buffers."""
    import types

    s = make_server(transport="loopback")
    pools = Pools(3)
    made = [
        manager(conn, monkeypatch, s, "decode", pools),
        manager(conn, monkeypatch, s, "prefill", pools, SGLANG_KVSERVICE_LANDING_TTL_MS=TTL_MS),
        manager(
            conn,
            monkeypatch,
            s,
            "decode",
            pools,
            types.SimpleNamespace(disaggregation_decode_enable_radix_cache=True),
            SGLANG_KVSERVICE_LANDING_TTL_MS=TTL_MS,
        ),
    ]
    on = manager(conn, monkeypatch, s, "decode", pools, SGLANG_KVSERVICE_LANDING_TTL_MS=TTL_MS)
    try:
        assert [m.landing_ttl_ms for m in made] == [0, 0, 0]
        assert on.landing_ttl_ms == int(TTL_MS)
        on.state_names = [["state0.0"]]
        assert on._landing_ttl_ms(int(TTL_MS), None) == 0
        recv = conn.KVServiceReceiver(made[0], "127.0.0.1:1", 15)
        recv.init(0)
        assert recv._landing is None  # the default path posts nothing before send_metadata
    finally:
        for m in [*made, on]:
            m.close()
        pools.close()


def test_the_bootstrap_server_keeps_page_counts_apart_from_rooms(conn) -> None:
    """PUT /room/<r>/pages is the prefill's count for a landing room: read once, and never a room."""
    server = conn.KVServiceBootstrapServer("127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/room/5"
    try:
        assert conn._http("PUT", url, {"peer": "p", "decode_prefix_len": 0, "landing": True})[0] == 200
        assert conn._http("PUT", url + "/pages", {"pages": 9})[0] == 200
        assert conn._http("PUT", url + "/pages", {"peer": "p"})[0] == 400
        assert conn._http("GET", url + "/pages") == (200, {"pages": 9})
        assert conn._http("GET", url + "/pages")[0] == 404
        assert conn._http("GET", url) == (200, {"peer": "p", "decode_prefix_len": 0, "landing": True})
        assert conn._http("PUT", url + "/other", {"pages": 1})[0] == 400
    finally:
        server.close()


def test_a_room_is_read_by_every_attention_tp_rank_then_goes(conn) -> None:
    """Each attention TP rank of the prefill runs a sender of the room: the decode's post stays
    until all of them read it (a rank reading twice counts once); a plain GET is one reader."""
    server = conn.KVServiceBootstrapServer("127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/room/6"
    post = {"peer": "p", "decode_prefix_len": 2}
    try:
        assert conn._http("PUT", url, post)[0] == 200
        assert conn._http("GET", url + "?rank=0&ranks=2") == (200, post)
        assert conn._http("GET", url + "?rank=0&ranks=2")[0] == 200  # the same rank again
        assert conn._http("GET", url + "?rank=1&ranks=2")[0] == 200  # the last of the two
        assert conn._http("GET", url + "?rank=1&ranks=2")[0] == 404
        assert conn._http("PUT", url, post)[0] == 200
        assert conn._http("GET", url)[0] == 200 and conn._http("GET", url)[0] == 404
    finally:
        server.close()


def test_a_held_get_is_answered_when_the_room_is_posted(conn) -> None:
    """GET ?wait_ms= waits for the decode's post (a PUT wakes it) and is 404 once the wait ends."""
    server = conn.KVServiceBootstrapServer("127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/room/8"
    post = {"peer": "p", "decode_prefix_len": 0}
    try:
        t0 = time.monotonic()
        assert conn._http("GET", url + "?wait_ms=200")[0] == 404
        assert time.monotonic() - t0 >= 0.2
        threading.Timer(0.1, conn._http, ("PUT", url, post)).start()
        t0 = time.monotonic()
        assert conn._http("GET", url + "?wait_ms=1500") == (200, post)
        assert time.monotonic() - t0 < 1.0  # woken by the PUT, not at the end of its wait
    finally:
        server.close()


def test_a_sender_asks_again_when_its_get_times_out(node, monkeypatch) -> None:
    """A GET of the room that times out (a busy bootstrap server) is asked again, not a failure."""
    sender_module = sys.modules[node["conn"].KVServiceSender.__module__]
    real, calls = sender_module.http_json, []

    def flaky(method: str, url: str, body: Any = None) -> Any:
        calls.append(url)
        if len(calls) == 1:
            raise TimeoutError("timed out")
        return real(method, url, body)

    monkeypatch.setattr(sender_module, "http_json", flaky)
    send = node["conn"].KVServiceSender(node["mp"], node["addr"], 21)
    post = {"peer": "p", "decode_prefix_len": 0}
    assert node["conn"]._http("PUT", f"http://{node['addr']}/room/21", post)[0] == 200
    eventually(lambda: send.poll() == node["conn"].KVPoll.WaitingForInput)
    assert len(calls) >= 2
