"""A finished transfer never takes another byte, on every route: a SendDelta repeated after
DONE (as a retry would) writes nothing into the receiver's pages, which its engine may own again.
And the sender's counters are right on every route."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import KVClientError

from tests.support.nodes import Node, Nodes, eventually, regions


@pytest.fixture(params=["lane", "grpc", "cross-lane", "cross-grpc"])
def pair(request: Any, make_server: Any, tmp_path: Any) -> Iterator[Any]:
    route = request.param
    if route.startswith("cross"):
        pytest.importorskip("nixl")
        n: Any = Nodes(make_server, str(tmp_path), cross_lane=route == "cross-lane")
        for i in range(2):  # the first opens A's channel to B: offers (and lane slots) travel on it
            assert n.move(f"warm{i}", [1], [3 + i])[0].state == "DONE"
    else:
        n = Node(make_server(transport="loopback", lane=route == "lane"), route == "lane")
    n.route = route
    yield n
    n.close()


def _send_again(n: Any, tid: str, src: list[int], path: str) -> str:
    """Repeat the SendDelta of ``tid``; once the sending service has settled it, '' or the
    refusal's code. (How the repeat ends on the sender is not the point: Poll keeps showing the
    finished transfer's DONE; what the receiver's pages hold is.)"""
    try:
        n.a.kv.send_delta(tid, n.a.bs, src_page_indices=src, peer_address=n.peer, path=path)
    except KVClientError as exc:
        return f"refused {exc.code.name}"
    table = getattr(n, "sa", getattr(n, "server", None)).node.transfers.table
    eventually(
        lambda: not [r for r in table.live() if r.transfer_id == tid], 20, f"the re-send of {tid} settled"
    )
    return ""


@pytest.mark.parametrize("path", ["auto", "direct", "packed"])
def test_a_send_repeated_after_done_writes_nothing(pair: Any, path: str) -> None:
    """Re-sending a DONE transfer is refused or fails; the receiver's pages keep what DONE left."""
    n = pair
    r, s = n.move("t1", [1, 2], [5, 6])
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    done = n.b.snapshot()
    rng = np.random.default_rng(9)
    for reg in regions(n.a.pool):  # the sender's pages change, as a prefill reusing them would
        reg[[1, 2]] = rng.integers(0, 256, reg[[1, 2]].shape, dtype=np.uint8)
    got = _send_again(n, "t1", [1, 2], path)
    assert "INVALID_ARGUMENT" not in got, got  # the re-send itself is well formed
    assert n.b.changed(done) == set(), f"{n.route}: the re-send wrote pages of a finished transfer"
    (r2,) = n.b.kv.poll(["t1"])
    assert r2.state == "DONE"


def test_sender_counts_pages_sent_and_skipped(pair: Any) -> None:
    """The sender's status says how many pages it sent and how many the receiver held already."""
    n = pair
    n.b.kv.expect_delta(
        "c1",
        n.b.bs,
        prefix_pages=2,
        dst_page_indices=[7, 8, 9],
        **({"sender_address": n.sa.app.peer_address} if n.route.startswith("cross") else {}),
    )
    n.a.kv.send_delta("c1", n.a.bs, src_page_indices=[10, 11, 12, 13, 14], peer_address=n.peer)
    (r,) = n.b.kv.wait("c1", timeout=20)
    (s,) = n.a.kv.wait("c1", timeout=20)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert (r.pages_sent, r.pages_skipped) == (3, 2), r
    assert (s.pages_sent, s.pages_skipped) == (3, 2), f"{n.route}: {s}"
    # what Poll says once the service booked it (the lane's END told the engine first)
    polled = eventually(lambda: next((x for x in n.a.kv.poll(["c1"]) if x.role == "SENDER"), None), 10)
    assert (polled.pages_sent, polled.pages_skipped) == (3, 2), f"{n.route}: Poll says {polled}"
    if n.route in ("lane", "cross-lane"):
        assert "lane" in s.route_note, s


def test_a_claimed_landing_takes_nothing_from_a_resend(make_server: Any) -> None:
    """A landing claimed (DONE), then sent again: refused or failed, the pages keep the claim's
    bytes and nothing new lands."""
    n = Node(make_server(transport="loopback", lane=True), True)
    try:
        st = n.b.kv.expect_landing("l1", n.b.bs, prefix_pages=0, pages=2)
        assert st.state == "PENDING", st
        n.a.kv.send_delta("l1", n.a.bs, src_page_indices=[1, 2], peer_address=n.peer)
        (r,) = n.b.kv.wait_landed("l1", timeout=10)
        assert r.state == "LANDED", r
        c = n.b.kv.claim("l1", n.b.bs, dst_page_indices=[5, 6])
        assert c.status.state == "DONE", c
        done = n.b.snapshot()
        rng = np.random.default_rng(4)
        for reg in regions(n.a.pool):
            reg[[1, 2]] = rng.integers(0, 256, reg[[1, 2]].shape, dtype=np.uint8)
        got = _send_again(n, "l1", [1, 2], "auto")
        assert "INVALID_ARGUMENT" not in got, got
        assert n.b.changed(done) == set()
        with pytest.raises(KVClientError):  # nothing landed to claim again
            n.b.kv.claim("l1", n.b.bs, dst_page_indices=[7, 8])
        assert n.b.changed(done) == set()
    finally:
        n.close()
