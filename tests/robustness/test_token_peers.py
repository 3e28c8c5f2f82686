"""Peers by token (Helm's default) or --insecure take the fast path too: ExpectDelta's plan is
offered on the sending service's channel and a one-chunk delta goes over the cross-node lane,
byte exact; only the sender the offer went to can commit it."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.nodes import Nodes


@pytest.mark.parametrize("auth", ["token", "insecure"])
def test_token_peers_take_the_cross_node_lane(make_server: Any, tmp_path: Any, auth: str) -> None:
    pytest.importorskip("nixl")
    n = Nodes(make_server, str(tmp_path), cross_lane=True, auth=auth)
    try:
        for i in range(2):  # the first opens A's channel to B: offers (and lane slots) travel on it
            r, s = n.move(f"warm{i}", [1], [3 + i])
            assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
        before = n.b.snapshot()
        r, s = n.move("t1", [5, 6, 7], [9, 10, 11])
        assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
        assert r.route_note == "cross-node lane" and s.route_note == "cross-node lane", (r, s)
        assert n.b.pages([9, 10, 11]) == n.a.pages([5, 6, 7])
        assert n.b.changed(before) <= {9, 10, 11}
    finally:
        n.close()
