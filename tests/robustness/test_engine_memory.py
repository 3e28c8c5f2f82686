"""An engine shrinking its shared memory under the service (``ftruncate``, as its owner may)
fails the transfers that touch it, naming its buffer set, on every route; the service keeps
serving every other engine (it used to die of SIGBUS in the copy)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kvservice_client._errors import FailedPrecondition

from tests.support.nodes import Node, Nodes


@pytest.fixture(params=[True, False], ids=["lane", "grpc"])
def node(request: Any, make_server: Any) -> Iterator[Node]:
    n = Node(make_server(transport="loopback", lane=request.param), request.param)
    yield n
    n.close()


@pytest.mark.parametrize("who", ["sender", "receiver"])
def test_a_truncated_pool_fails_its_transfer_and_nothing_else(node: Node, who: str) -> None:
    """The transfer over a truncated pool ends FAILED naming that buffer set; the service lives."""
    n = node
    r, s = n.move("warm", [1], [3])
    assert (r.state, s.state) == ("DONE", "DONE")
    victim = n.a if who == "sender" else n.b
    victim.truncate()
    r, s = n.move("t1", [1, 2], [5, 6])
    assert r.state == "FAILED", r
    assert victim.bs in r.error and "shrank" in r.error, r.error
    assert s.state in ("FAILED", "ABORTED"), s
    # every other engine's transfers go on, byte exact
    if who == "receiver":
        before = n.c.snapshot()
        r2, _ = n.move("t2", [7, 8], [9, 10], into=n.c)
        assert r2.state == "DONE", r2
        assert n.c.pages([9, 10]) == n.a.pages([7, 8])
        assert n.c.changed(before) <= {9, 10}


def test_operators_see_the_repaired_faults(make_server: Any) -> None:
    """/metrics counts the repaired faults (kvservice_engine_memory_faults_total grows)."""
    import urllib.request

    n = Node(make_server(transport="loopback", lane=True, metrics_port=-1), True)
    url = f"http://127.0.0.1:{n.server.app.metrics_port}/metrics"

    def faults() -> float:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        line = next(x for x in text.splitlines() if x.startswith("kvservice_engine_memory_faults_total "))
        return float(line.split()[1])

    try:
        before = faults()
        n.b.truncate()
        assert n.move("t1", [1], [2])[0].state == "FAILED"
        assert faults() > before
    finally:
        n.close()


def test_a_truncated_pool_takes_no_new_transfer(node: Node) -> None:
    """Once the service saw a pool shrink, SendDelta / ExpectDelta on it fail at once, naming it."""
    n = node
    n.b.truncate()
    r, _ = n.move("t1", [1], [2])
    assert r.state == "FAILED"
    with pytest.raises(FailedPrecondition, match=n.b.bs):
        n.b.kv.expect_delta("t2", n.b.bs, prefix_pages=0, dst_page_indices=[4])
    # its owner unregisters it; the service serves the others
    n.b.kv.unregister_buffers(n.b.bs)
    r2, s2 = n.move("t3", [4], [4], into=n.c)
    assert (r2.state, s2.state) == ("DONE", "DONE")


@pytest.mark.parametrize("cross_lane", [True, False], ids=["cross-lane", "grpc"])
@pytest.mark.parametrize("who", ["sender", "receiver"])
def test_across_services_a_truncated_pool_fails_only_its_transfer(
    make_server: Any, tmp_path: Any, cross_lane: bool, who: str
) -> None:
    """Across services (the cross-node lane, or gRPC over NIXL) the same: FAILED naming the
    buffer set on the receiver, not DONE on the sender, both services serving."""
    pytest.importorskip("nixl")
    n = Nodes(make_server, str(tmp_path), cross_lane)
    try:
        for i in range(2):  # the first opens A's channel to B: offers (and lane slots) travel on it
            r, s = n.move(f"warm{i}", [1], [3 + i])
            assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
        victim = n.a if who == "sender" else n.b
        victim.truncate()
        r, s = n.move("t1", [1, 2], [5, 6])
        assert r.state == "FAILED" and victim.bs in r.error and "shrank" in r.error, r
        assert s.state in ("FAILED", "ABORTED"), s
        before = n.c.snapshot()
        if who == "receiver":
            r2, s2 = n.move("t2", [7, 8], [9, 10], into=n.c)
            assert (r2.state, s2.state) == ("DONE", "DONE"), (r2, s2)
            assert n.c.pages([9, 10]) == n.a.pages([7, 8])
            assert n.c.changed(before) <= {9, 10}
    finally:
        n.close()
