"""The cross-node lane on CPU (two services on NIXL over UCX, shm pools, memcpy in the native
threads): an engine's delta goes from its service's lane into the other service's lane and
pages with no Python on its path; what it hands back to gRPC; nothing written outside the
declared pages or after an Abort returned."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import Client, Layout, ShmKVPool

from tests.support.lane import lane_of
from tests.support.pki import CA, mtls_peer
from tests.support.poll import eventually

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=32, total_kv_heads=2, head_dim=8, dtype="float16")
pytest.importorskip("nixl")


def regions(pool: ShmKVPool, layout: Layout = LAYOUT) -> list[np.ndarray]:
    return [pool.k(i) for i in range(layout.num_layers)] + [pool.v(i) for i in range(layout.num_v_regions)]


class Nodes:
    """A prefill service (A) and a decode service (B) that do not map each other's pools."""

    def __init__(self, make_server: Any, tmp: str, layout: Layout = LAYOUT, **cfg: Any) -> None:
        kw = {"transport": "nixl", "same_host_route": "off", "transfer_integrity": False, **cfg}
        ca = CA(tmp, "cluster")  # offers go only to a proven identity (mutual TLS between peers)
        self.sa, self.sb = (make_server(**kw, **mtls_peer(ca, name)) for name in ("prefill-a", "decode-b"))
        self.lanes = lane_of(self.sa), lane_of(self.sb)
        self.layout = layout
        self.pa, self.pb = ShmKVPool.create(layout), ShmKVPool.create(layout)
        rng = np.random.default_rng(5)
        for pool in (self.pa, self.pb):
            for r in regions(pool, layout):
                r[:] = rng.integers(0, 256, r.shape, dtype=np.uint8)
        self.ka = Client(self.sa.address, client_name="prefill")
        self.kb = Client(self.sb.address, client_name="decode")
        self.a = self.ka.register_buffers(layout, self.pa.k_regions, self.pa.v_regions).buffer_set_id
        self.b = self.kb.register_buffers(layout, self.pb.k_regions, self.pb.v_regions).buffer_set_id
        self.peer = self.sb.app.peer_address

    def cross(self, i: int) -> Any:
        return self.lanes[i].book.cross

    def pages(self, pool: ShmKVPool, pages: list[int]) -> list[bytes]:
        return [r[p].tobytes() for r in regions(pool, self.layout) for p in pages]

    def snapshot(self) -> list[np.ndarray]:
        return [r.copy() for r in regions(self.pb, self.layout)]

    def changed(self, before: list[np.ndarray]) -> set[int]:
        got: set[int] = set()
        for old, now in zip(before, regions(self.pb, self.layout), strict=True):
            got |= set(np.flatnonzero((old != now).any(axis=1)).tolist())
        return got

    def expect(self, tid: str, dst: list[int], prefix: int = 0, **kw: Any) -> None:
        self.kb.expect_delta(
            tid,
            self.b,
            prefix_pages=prefix,
            dst_page_indices=dst,
            sender_address=self.sa.app.peer_address,
            **kw,
        )

    def offered(self, tid: str) -> None:
        """Until service A's lane holds B's offer of ``tid`` (it travels on A's open channel)."""
        eventually(lambda: self.lanes[0].book.cross.tx.holds_offer(tid), 10, f"offer of {tid}")

    def offered_plain(self, tid: str) -> None:
        """Until A's channel holds B's offer of ``tid`` (one without a lane slot)."""
        chan = self.sa.app.node.transfers.dispatch.channels[self.peer]
        eventually(lambda: chan.offers.get(tid) is not None, 10, f"offer of {tid}")

    def close(self) -> None:
        self.ka.close()
        self.kb.close()
        self.pa.close()
        self.pb.close()


@contextlib.contextmanager
def started(make_server: Any, tmp: str, **kw: Any) -> Iterator[Nodes]:
    """Nodes whose lanes both started (else the test skips), A's channel to B open, closed after."""
    n = Nodes(make_server, tmp, **kw)
    try:
        if n.cross(0) is None or n.cross(1) is None:
            pytest.skip("the cross-node lane did not start (no NIXL C API here)")
        # a first transfer over gRPC opens A's channel to B: offers travel on it
        n.expect("warm", [0])
        n.ka.send_delta("warm", n.a, src_page_indices=[0], peer_address=n.peer)
        assert n.kb.wait("warm", timeout=30)[0].state == "DONE"
        yield n
    finally:
        n.close()


@pytest.fixture
def nodes(make_server: Any, tmp_path: Any) -> Iterator[Nodes]:
    with started(make_server, str(tmp_path)) as n:
        yield n


def test_multi_turn_goes_over_the_cross_node_lane_byte_exact(nodes: Nodes) -> None:
    n = nodes
    src_seq, dst_seq = [3, 9], [4, 17]
    sent0, got0 = n.cross(0).n_sent, n.cross(1).n_received
    for turn, (s, d) in enumerate([([5, 30], [2, 8]), ([11], [21]), ([1, 2, 6], [25, 26, 27])]):
        tid = f"turn{turn}"
        before = n.snapshot()
        n.expect(tid, d, prefix=len(dst_seq))
        src_seq += s
        dst_seq += d
        n.offered(tid)
        st = n.ka.send_delta(tid, n.a, src_page_indices=src_seq, peer_address=n.peer)
        assert st.state != "FAILED"
        assert n.ka.wait(tid, timeout=30)[0].state == "DONE"
        (got,) = n.kb.wait(tid, timeout=30)
        assert got.state == "DONE", got
        assert n.pages(n.pb, d) == n.pages(n.pa, s)
        assert n.changed(before) <= set(d)  # nothing outside the declared pages
    # the engines had their END from the lanes; the services' books follow
    eventually(lambda: n.cross(0).n_sent - sent0 == 3 and n.cross(1).n_received - got0 == 3, 10, "booked")
    st = eventually(lambda: next((x for x in n.kb.poll(["turn2"]) if x.state == "DONE"), None), 10, "poll")
    assert st.pages_sent == 3 and st.pages_skipped == 5, st
    (sa,) = n.ka.poll(["turn2"])
    assert sa.state == "DONE" and sa.bytes_sent == 3 * LAYOUT.page_bytes_all_layers, sa
    eventually(
        lambda: n.lanes[0].native.cross_count() == 0 and n.lanes[1].native.cross_count() == 0,
        10,
        "nothing armed",
    )


def test_a_send_right_after_expect_waits_for_the_offer(nodes: Nodes) -> None:
    """ExpectDelta and the prefill race: the lane holds a SEND_TO until the offer arrives."""
    n = nodes
    sent0 = n.cross(0).n_sent
    for i in range(5):
        n.expect(f"race{i}", [10 + i])
        n.ka.send_delta(f"race{i}", n.a, src_page_indices=[20 + i], peer_address=n.peer)
        assert n.kb.wait(f"race{i}", timeout=30)[0].state == "DONE"
        assert n.pages(n.pb, [10 + i]) == n.pages(n.pa, [20 + i])
    # without the wait a send right after ExpectDelta beats the offer and takes gRPC; with it,
    # only an offer slower than 20 ms does (a loaded 2-core CI VM: allow two of five)
    eventually(lambda: n.cross(0).n_sent - sent0 >= 3, 10, "three of five on the lane")


def test_receiver_abort_before_the_send_writes_nothing(nodes: Nodes) -> None:
    n = nodes
    n.expect("ab", [12, 13])
    n.offered("ab")
    before = n.snapshot()
    n.kb.abort("ab", reason="decode gave up")
    (r,) = n.kb.wait("ab", timeout=10)
    assert r.state == "ABORTED"
    eventually(lambda: n.lanes[0].native.disarm_out("ab", 0) == 0, 10, "the sender's lane dropped the offer")
    st = n.ka.send_delta("ab", n.a, src_page_indices=[1, 2], peer_address=n.peer)
    (s,) = n.ka.wait("ab", timeout=30)
    assert s.state in ("FAILED", "ABORTED"), (st, s)
    time.sleep(0.2)
    assert n.changed(before) == set()  # not a byte in the receiver's pages


def test_a_grpc_sender_takes_an_armed_transfer_and_the_slot_goes(nodes: Nodes) -> None:
    n = nodes
    free0 = n.cross(1).arenas[-1].slots.free_bytes
    n.expect("grpc", [14])
    n.offered("grpc")
    assert n.cross(1).arenas[-1].slots.free_bytes < free0  # a slot is armed for it
    with Client(n.sa.address, client_name="no-lane", lane=False) as k:
        a = k.register_buffers(LAYOUT, n.pa.k_regions, n.pa.v_regions).buffer_set_id
        k.send_delta("grpc", a, src_page_indices=[9], peer_address=n.peer)
        assert k.wait("grpc", timeout=30)[0].state == "DONE"
    assert n.kb.wait("grpc", timeout=30)[0].state == "DONE"
    assert n.pages(n.pb, [14]) == n.pages(n.pa, [9])
    assert ("grpc", 0) not in n.cross(1).rx._in  # the slot left the lane (quarantined till the deadline)
    assert n.lanes[0].native.disarm_out("grpc", 0) == 0


def test_a_bad_source_page_gets_the_grpc_error_and_changes_nothing(nodes: Nodes) -> None:
    n = nodes
    n.expect("bad", [15])
    n.offered("bad")
    before = n.snapshot()
    with pytest.raises(Exception, match="src_page_indices"):
        n.ka.send_delta("bad", n.a, src_page_indices=[LAYOUT.num_pages + 3], peer_address=n.peer)
    assert n.changed(before) == set()


def test_a_delta_larger_than_the_staging_goes_over_grpc(make_server: Any, tmp_path: Any) -> None:
    """lane_cross_mb=1 (512 KiB receive) and 1 MiB pages: one page does not fit, its offer comes
    without a slot and the send goes over gRPC, byte exact."""
    big = Layout.mha(num_layers=4, page_size=64, num_pages=8, total_kv_heads=8, head_dim=128, dtype="float16")
    assert big.page_bytes_all_layers > 1 << 19
    with started(make_server, str(tmp_path), layout=big, lane_cross_mb=1) as n:
        sent0, free0 = n.cross(0).n_sent, n.cross(1).arenas[-1].slots.free_bytes
        n.expect("big", [5])
        n.offered_plain("big")
        assert n.cross(1).arenas[-1].slots.free_bytes == free0  # no slot taken
        n.ka.send_delta("big", n.a, src_page_indices=[3], peer_address=n.peer)
        (got,) = n.kb.wait("big", timeout=30)
        assert got.state == "DONE" and got.route_note != "cross-node lane", got
        assert n.pages(n.pb, [5]) == n.pages(n.pa, [3])
        assert n.cross(0).n_sent == sent0


def test_host_pools_send_a_delta_above_half_the_staging_over_grpc_by_default(
    make_server: Any, tmp_path: Any
) -> None:
    """lane_cross_stream=gpu (the default) and host pools: the 30-page delta's offer has no slot
    and the gRPC route moves it (DIRECT into the registered pools beats pack + WRITE + unpack)."""
    lay = Layout.mha(num_layers=4, page_size=16, num_pages=64, total_kv_heads=4, head_dim=32, dtype="float16")
    with started(make_server, str(tmp_path), layout=lay, lane_cross_mb=1) as n:
        sent0 = n.cross(0).n_sent
        n.expect("host", list(range(33, 63)))
        n.offered_plain("host")
        n.ka.send_delta("host", n.a, src_page_indices=list(range(1, 31)), peer_address=n.peer)
        (got,) = n.kb.wait("host", timeout=30)
        assert got.state == "DONE" and got.route_note != "cross-node lane", got
        assert n.pages(n.pb, list(range(33, 63))) == n.pages(n.pa, list(range(1, 31)))
        assert n.cross(0).n_sent == sent0


def test_a_delta_above_half_the_staging_streams_through_the_lane(make_server: Any, tmp_path: Any) -> None:
    """lane_cross_stream=all, lane_cross_mb=1 (512 KiB receive), 32 KiB pages: a 30-page delta is offered a
    256 KiB slot and streams through it in 4-page chunks; the next turn (13 pages, prefix 30)
    too; byte exact, delta only, nothing outside the declared pages, the slot back after."""
    lay = Layout.mha(num_layers=4, page_size=16, num_pages=64, total_kv_heads=4, head_dim=32, dtype="float16")
    assert lay.page_bytes_all_layers == 32 << 10
    with started(make_server, str(tmp_path), layout=lay, lane_cross_mb=1, lane_cross_stream="all") as n:
        sent0, free0 = n.cross(0).n_sent, n.cross(1).arenas[-1].slots.free_bytes
        src_seq: list[int] = []
        dst_seq: list[int] = []
        turns = [(list(range(1, 31)), list(range(33, 63))), (list(range(40, 53)), list(range(1, 14)))]
        for turn, (s, d) in enumerate(turns):
            tid = f"stream{turn}"
            before = n.snapshot()
            n.expect(tid, d, prefix=len(dst_seq))
            n.offered(tid)
            assert n.cross(1).arenas[-1].slots.free_bytes == free0 - (256 << 10)  # half the staging
            src_seq += s
            dst_seq += d
            n.ka.send_delta(tid, n.a, src_page_indices=src_seq, peer_address=n.peer)
            assert n.ka.wait(tid, timeout=30)[0].state == "DONE"
            (got,) = n.kb.wait(tid, timeout=30)
            assert got.state == "DONE", got
            assert n.pages(n.pb, d) == n.pages(n.pa, s)
            assert n.changed(before) <= set(d)
            eventually(lambda t=turn: n.cross(0).n_sent - sent0 == t + 1, 10, "booked on the lane")
        st = eventually(lambda: next((x for x in n.kb.poll(["stream1"]) if x.state == "DONE"), None), 10, "")
        assert st.pages_sent == 13 and st.pages_skipped == 30 and st.route_note == "cross-node lane", st
        eventually(lambda: n.cross(1).arenas[-1].slots.free_bytes == free0, 10, "the slot back")


def test_slot_bytes_one_write_or_half_the_staging() -> None:
    from kvservice.transfer.lane.cross import slot_bytes

    assert slot_bytes(4, 1000, 10_000) == 4000  # fits in half: the delta, one WRITE
    assert slot_bytes(6, 1000, 10_000) == 5000  # streams through half the staging
    assert slot_bytes(6, 3000, 10_000) == 0  # half holds less than two pages: gRPC
    assert slot_bytes(6, 1000, 10_000, streams=False) == 0  # host pools by default: gRPC (DIRECT)


def test_slots_first_fit_and_coalescing() -> None:
    from kvservice.transfer.lane.cross import Slots

    s = Slots(16 * 4096)
    a, b, c = s.take(4096), s.take(5000), s.take(4096)
    assert (a, b, c) == (0, 4096, 3 * 4096)  # 5000 bytes take two 4 KiB steps
    assert s.take(13 * 4096) is None and s.free_bytes == 12 * 4096
    s.give(b, 5000)
    assert s.take(8192) == 4096  # the freed range is found first
    s.give(4096, 8192)
    s.give(a, 4096)
    s.give(c, 4096)
    assert s.free_bytes == 16 * 4096 and s.take(16 * 4096) == 0  # all coalesced into one range


def test_tp2_to_tp2_each_rank_lands_in_its_own_rank(make_server: Any, tmp_path: Any) -> None:
    """Two ranks each side, one transfer id: each sender rank's SEND_TO pairs with the offer of
    the receiver rank of the same number (never the other one's slot)."""
    lay = [
        Layout.mha(
            num_layers=2,
            page_size=4,
            num_pages=32,
            total_kv_heads=4,
            head_dim=8,
            dtype="float16",
            tp_size=2,
            tp_rank=r,
        )  # fmt: skip
        for r in (0, 1)
    ]
    with started(make_server, str(tmp_path)) as n:
        rng = np.random.default_rng(9)
        pa = [ShmKVPool.create(x) for x in lay]
        pb = [ShmKVPool.create(x) for x in lay]
        for p in pa + pb:
            for r in regions(p, lay[0]):
                r[:] = rng.integers(0, 256, r.shape, dtype=np.uint8)
        ka = [Client(n.sa.address, client_name=f"prefill-{r}") for r in (0, 1)]
        kb = [Client(n.sb.address, client_name=f"decode-{r}") for r in (0, 1)]
        a = [
            k.register_buffers(x, p.k_regions, p.v_regions).buffer_set_id
            for k, x, p in zip(ka, lay, pa, strict=True)
        ]
        b = [
            k.register_buffers(x, p.k_regions, p.v_regions).buffer_set_id
            for k, x, p in zip(kb, lay, pb, strict=True)
        ]
        sent0 = n.cross(0).n_sent
        for r in (0, 1):
            kb[r].expect_delta("tp2", b[r], prefix_pages=0, dst_page_indices=[7, 8],
                               sender_address=n.sa.app.peer_address)  # fmt: skip
        eventually(lambda: n.lanes[0].native.cross_count() >= 2, 10, "both ranks' offers")
        for r in (1, 0):
            ka[r].send_delta("tp2", a[r], src_page_indices=[3 + r, 10 + r], peer_address=n.peer)
        for r in (0, 1):
            (st,) = kb[r].wait("tp2", timeout=30)
            assert st.state == "DONE", st
            got = [x[p].tobytes() for x in regions(pb[r], lay[r]) for p in (7, 8)]
            want = [x[p].tobytes() for x in regions(pa[r], lay[r]) for p in (3 + r, 10 + r)]
            assert got == want, f"rank {r}"
        eventually(lambda: n.cross(0).n_sent - sent0 == 2, 10, "both ranks on the lane")
        for k in ka + kb:
            k.close()
        for p in pa + pb:
            p.close()


def test_a_peer_lane_of_another_wire_version_is_not_paired(nodes: Nodes) -> None:
    """A rolling upgrade: metadata without this lane's version tag pairs with nothing (the
    peer's transfers take gRPC), and the proper one pairs again."""
    from kvservice.transfer.lane.cross import WIRE

    cb = nodes.cross(1)
    md = nodes.cross(0).metadata()
    assert md.startswith(WIRE)
    assert cb.load_peer("old-peer", md[len(WIRE) :]) == ""  # an older lane's bare metadata
    assert "old-peer" not in cb._agents
    assert cb.load_peer("old-peer", b"KVX9" + md[len(WIRE) :]) == ""
    assert cb.load_peer("old-peer", md) == nodes.cross(0).agent_name


@pytest.mark.parametrize("no_mark", [False, True])
def test_a_lane_sent_transfer_marks_the_p_d_duplicate_as_grpc_does(nodes: Nodes, no_mark: bool) -> None:
    """The receiver publishes the pages: the sending service marks its copies (SuggestEvictions
    offers them first), unless SendDelta said no_duplicate_mark."""
    n = nodes
    tokens = np.arange(700, 700 + 3 * LAYOUT.page_size)
    n.ka.publish_pages(n.a, [6, 7, 8], tokens=tokens)
    tid = f"dup-{no_mark}"
    n.expect(tid, [20, 21, 22], publish_tokens=tokens)
    n.offered(tid)
    sent0 = n.cross(0).n_sent
    n.ka.send_delta(tid, n.a, src_page_indices=[6, 7, 8], peer_address=n.peer, no_duplicate_mark=no_mark)
    assert n.kb.wait(tid, timeout=30)[0].state == "DONE"
    eventually(lambda: n.cross(0).n_sent == sent0 + 1, 10, "sent on the lane")

    def duplicated() -> int:
        (info,) = [i for i in n.ka.get_stats().buffer_sets if i.buffer_set_id == n.a]
        return int(info.duplicated_pages)

    if no_mark:
        time.sleep(0.2)
        assert duplicated() == 0
    else:
        eventually(lambda: duplicated() == 3, 10, "3 duplicated pages")
        assert n.ka.suggest_evictions(n.a, 32).duplicated[:3] == (True,) * 3
    assert not n.cross(0).tx._out  # nothing kept per offer
