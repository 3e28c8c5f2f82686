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

import os
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "sglang"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_stub  # noqa: E402

LAYERS, PAGE, HEADS, DIM, PAGES = 2, 4, 2, 16, 64
ITEM = PAGE * HEADS * DIM * 2  # float16 bytes per page per buffer
AUX = [(8, 16), (64, 16)]  # metadata buffers: (row bytes, rows), e.g. output ids, hidden states
TTL_MS = "20000"


@pytest.fixture(scope="module")
def conn() -> Any:
    """kvservice_sglang.conn over the real SGLang, or over the stand-in (removed afterwards)."""
    real = os.environ.get("KVS_SGLANG_REAL") == "1"
    try:
        import sglang.srt.disaggregation.base.conn  # noqa: F401
    except ImportError:
        if real:
            raise
        added = sglang_stub.install()
    else:
        added = []
    import kvservice_sglang.conn as c

    if real:  # the package's own base classes, not the stand-in's
        assert c.BaseKVReceiver.__module__ == "sglang.srt.disaggregation.base.conn", c.BaseKVReceiver
    yield c
    if added:
        sglang_stub.uninstall(added)
        for name in ("kvservice_sglang.conn", "kvservice_sglang"):
            sys.modules.pop(name, None)


class Pools:
    """SGLang-shaped pools in shm: K_0..K_{L-1}, V_0..V_{L-1}, then the metadata buffers."""

    def __init__(self, seed: int) -> None:
        kv = 2 * LAYERS * PAGES * ITEM
        self.shm = shared_memory.SharedMemory(create=True, size=kv + sum(r * n for r, n in AUX))
        raw = np.frombuffer(self.shm.buf, dtype=np.uint8)
        raw[:] = np.random.default_rng(seed).integers(0, 255, raw.size, dtype=np.uint8)
        self.bufs = [
            raw[i * PAGES * ITEM : (i + 1) * PAGES * ITEM].reshape(PAGES, ITEM) for i in range(2 * LAYERS)
        ]
        self.aux, off = [], kv
        for row, n in AUX:
            self.aux.append(raw[off : off + row * n].reshape(n, row))
            off += row * n

    def kv_args(self, conn: Any) -> Any:
        a = conn.KVArgs()
        a.engine_rank, a.gpu_id, a.page_size = 0, 0, PAGE
        a.kv_data_ptrs = [b.ctypes.data for b in self.bufs]
        a.kv_data_lens = [PAGES * ITEM] * len(self.bufs)
        a.kv_item_lens = [ITEM] * len(self.bufs)
        a.kv_cache_dtype_str = "torch.float16"
        a.kv_head_num = a.total_kv_head_num = HEADS
        a.aux_data_ptrs = [x.ctypes.data for x in self.aux]
        a.aux_data_lens = [x.nbytes for x in self.aux]
        a.aux_item_lens = [x.shape[1] for x in self.aux]
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        return a

    def snapshot(self) -> list[np.ndarray]:
        return [b.copy() for b in self.bufs] + [x.copy() for x in self.aux]

    def close(self) -> None:
        del self.bufs, self.aux
        self.shm.close()
        self.shm.unlink()


def manager(
    conn: Any, monkeypatch: Any, server: Any, mode: str, pools: Pools, server_args: Any = None, **env: str
):
    monkeypatch.setenv("SGLANG_KVSERVICE_ADDRESS", server.address)
    monkeypatch.setenv("SGLANG_KVSERVICE_PEER_ADDRESS", server.app.peer_address)
    monkeypatch.delenv("SGLANG_KVSERVICE_LANDING_TTL_MS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return conn.KVServiceManager(pools.kv_args(conn), mode, server_args, False)


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


def until(pred: Any, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "not within time"
        time.sleep(0.005)


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
    until(lambda: send.poll() == poll.WaitingForInput)
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
    until(lambda: send.poll() in (poll.Success, poll.Failed))
    assert send.poll() == poll.Success, send.failed  # the prefill's pages are free: it landed
    rec = receiver_record(node, room)
    assert rec.landing and rec.state == "LANDED", rec
    assert recv.poll() == poll.WaitingForInput  # SGLang still waits to allocate
    assert landing_used(node) > 0
    for i, snap in enumerate(node["d"].snapshot()):
        np.testing.assert_array_equal(snap, before[i])  # nothing in the decode's pools yet
    recv.send_metadata(dst, aux_index=2, decode_prefix_len=0)
    until(lambda: recv.poll() in (poll.Success, poll.Failed))
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
    until(lambda: recv.poll() in (poll.Success, poll.Failed) and send.poll() in (poll.Success, poll.Failed))
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
    until(lambda: recv._landing.done())
    assert recv._landing.result() is None
    (ls,) = node["sd"].app.node.transfers.landing.stats()
    assert ls.refused == 1 and ls.used_bytes == 0, ls
    assert send.poll() == poll.Transferring  # its pages wait for the decode's allocation
    recv.send_metadata(dst, aux_index=4, decode_prefix_len=0)
    until(lambda: recv.poll() in (poll.Success, poll.Failed) and send.poll() in (poll.Success, poll.Failed))
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
    until(lambda: send.poll() == poll.Success)
    assert receiver_record(node, room).state == "LANDED"
    recv.clear()
    until(lambda: receiver_record(node, room).state == "ABORTED")
    until(lambda: landing_used(node) == 0)
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
        assert on._landing_ttl_ms(None) == 0
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
