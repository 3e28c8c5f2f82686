"""kvservice_sglang against the pinned sglang 0.5.23 package: the backend's classes driven in the
order SGLang's prefill and decode schedulers call them, over two real kvservice processes
(addresses in KVS_TEST_PREFILL / KVS_TEST_DECODE, started by tests/adapters/test_sglang_backend.py).

Host pools live in POSIX shared memory, as kvservice needs for CPU memory; the backend finds each
raw pointer's shm object from /proc/self/maps, as it would for an SGLang CPU pool put there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from multiprocessing import shared_memory

import numpy as np
import pytest
from kvservice_sglang import (
    KVServiceBootstrapServer,
    KVServiceManager,
    KVServiceReceiver,
    KVServiceSender,
    KVServiceTransferError,
)
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll

PREFILL, DECODE = os.environ.get("KVS_TEST_PREFILL", ""), os.environ.get("KVS_TEST_DECODE", "")
pytestmark = pytest.mark.skipif(not (PREFILL and DECODE), reason="needs two kvservice processes (KVS_TEST_*)")

LAYERS, PAGE, HEADS, DIM, PAGES = 2, 4, 2, 16, 64
ITEM = PAGE * HEADS * DIM * 2  # float16 bytes per page per buffer
AUX_ROW, AUX_ROWS = 64, 16
# state buffers of a hybrid model: (state type, [(slots, bytes per slot) per component tensor])
STATES = [("mamba", [(8, 96), (8, 40)]), ("swa", [(PAGES, ITEM)])]
StateSpec = list[tuple[str, list[tuple[int, int]]]]


def _kv_args(
    engine_rank: int, bufs: list[np.ndarray], item: int, dtype: str, heads: int, total: int, aux: np.ndarray
) -> KVArgs:
    """One rank's KVArgs: ``bufs`` of PAGES pages of ``item`` bytes, ``heads`` of ``total`` KV
    heads, one aux buffer, no state buffers."""
    a = KVArgs()
    a.engine_rank, a.gpu_id, a.page_size = engine_rank, 0, PAGE
    a.kv_data_ptrs = [b.ctypes.data for b in bufs]
    a.kv_data_lens = [PAGES * item] * len(bufs)
    a.kv_item_lens = [item] * len(bufs)
    a.kv_cache_dtype_str = dtype
    a.kv_head_num, a.total_kv_head_num = heads, total
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [aux.ctypes.data], [AUX_ROWS * AUX_ROW], [AUX_ROW]
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    return a


class Pools:
    """SGLang-shaped pools in shm: K_0..K_{L-1}, V_0..V_{L-1}, one aux buffer, then (``states``)
    the component tensors of ``STATES``."""

    def __init__(self, seed: int | None, states: StateSpec | None = None) -> None:
        self.state_types = [t for t, _ in states or []]
        shapes = [shape for _, comps in states or [] for shape in comps]
        kv_aux = 2 * LAYERS * PAGES * ITEM + AUX_ROWS * AUX_ROW
        self.shm = shared_memory.SharedMemory(create=True, size=kv_aux + sum(n * b for n, b in shapes))
        raw = np.frombuffer(self.shm.buf, dtype=np.uint8)
        if seed is not None:
            raw[:] = np.random.default_rng(seed).integers(0, 255, raw.size, dtype=np.uint8)
        self.bufs = [
            raw[i * PAGES * ITEM : (i + 1) * PAGES * ITEM].reshape(PAGES, ITEM) for i in range(2 * LAYERS)
        ]
        self.aux = raw[2 * LAYERS * PAGES * ITEM : kv_aux].reshape(AUX_ROWS, AUX_ROW)
        self.states: list[list[np.ndarray]] = []
        off = kv_aux
        for _, comps in states or []:
            self.states.append([])
            for n, b in comps:
                self.states[-1].append(raw[off : off + n * b].reshape(n, b))
                off += n * b

    def kv_args(self) -> KVArgs:
        a = _kv_args(0, self.bufs, ITEM, "torch.float16", HEADS, HEADS, self.aux)
        a.state_types = list(self.state_types)
        a.state_data_ptrs = [[t.ctypes.data for t in comps] for comps in self.states]
        a.state_data_lens = [[t.nbytes for t in comps] for comps in self.states]
        a.state_item_lens = [[t.shape[1] for t in comps] for comps in self.states]
        return a

    def snapshot(self) -> list[np.ndarray]:
        return [b.copy() for b in self.bufs] + [self.aux.copy()]

    def close(self) -> None:
        del self.bufs, self.aux, self.states
        self.shm.close()
        self.shm.unlink()


def _manager(monkeypatch, address: str, mode: str, pools: Pools, **env: str) -> KVServiceManager:
    monkeypatch.setenv("SGLANG_KVSERVICE_ADDRESS", address)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return KVServiceManager(pools.kv_args(), mode, None, False)


class MlaPools:
    """An MLA model's pools in shm: one latent buffer a layer ``[pages, page * 576]`` (bf16)."""

    ITEM = PAGE * 576 * 2

    def __init__(self, seed: int | None) -> None:
        size = LAYERS * PAGES * self.ITEM + AUX_ROWS * AUX_ROW
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        raw = np.frombuffer(self.shm.buf, dtype=np.uint8)
        if seed is not None:
            raw[:] = np.random.default_rng(seed).integers(0, 255, raw.size, dtype=np.uint8)
        n = PAGES * self.ITEM
        self.bufs = [raw[i * n : (i + 1) * n].reshape(PAGES, self.ITEM) for i in range(LAYERS)]
        self.aux = raw[LAYERS * n :].reshape(AUX_ROWS, AUX_ROW)

    def kv_args(self, engine_rank: int) -> KVArgs:
        return _kv_args(engine_rank, self.bufs, self.ITEM, "torch.bfloat16", 1, 1, self.aux)

    def close(self) -> None:
        del self.bufs, self.aux
        self.shm.close()
        self.shm.unlink()


@pytest.fixture
def node(monkeypatch):
    p_pools, d_pools = Pools(1), Pools(None)
    server = KVServiceBootstrapServer("127.0.0.1", 0)
    mp = _manager(monkeypatch, PREFILL, "prefill", p_pools, SGLANG_KVSERVICE_BOOTSTRAP_TIMEOUT_S="5")
    md = _manager(monkeypatch, DECODE, "decode", d_pools, SGLANG_KVSERVICE_DEADLINE_MS="8000")
    yield {"mp": mp, "md": md, "p": p_pools, "d": d_pools, "addr": f"127.0.0.1:{server.port}"}
    mp.close()
    md.close()
    server.close()
    p_pools.close()
    d_pools.close()


def _until(pred, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "not within time"
        time.sleep(0.005)


class Trace:
    """Poll states as seen by a scheduler loop (consecutive repeats dropped)."""

    def __init__(self, side) -> None:
        self.side, self.states = side, []

    def poll(self) -> int:
        s = self.side.poll()
        if not self.states or self.states[-1] != s:
            self.states.append(s)
        return s


def test_chunked_delta_transfer_in_sglang_order(node) -> None:
    room, prefix_len, prompt = 7, 12, 40  # the decode side holds 3 pages of the prompt already
    src = np.arange(10, 20)  # prefill's pages of the 10-page prompt
    dst = np.array([50, 41, 33, 60, 2, 9, 17])  # decode's pages past its prefix
    recv = Trace(KVServiceReceiver(node["md"], node["addr"], room))
    send = Trace(KVServiceSender(node["mp"], node["addr"], room))
    before = node["d"].snapshot()
    assert recv.poll() == KVPoll.Bootstrapping
    assert send.poll() == KVPoll.Bootstrapping  # no decode instance has claimed the room yet
    recv.side.init(0)
    assert recv.poll() == KVPoll.WaitingForInput
    recv.side.send_metadata(dst, aux_index=3, decode_prefix_len=prefix_len)
    _until(lambda: send.poll() == KVPoll.WaitingForInput)
    assert send.side.pop_decode_prefix_len() == prefix_len
    num_pages = -(-(prompt - prefix_len) // PAGE)
    send.side.init(num_pages, aux_index=5)
    send.side.send(src[3:7])  # chunked prefill: first chunk
    assert send.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring), send.side.failed
    send.side.send(src[7:])  # last chunk (carries the aux row)
    _until(
        lambda: (
            send.poll() in (KVPoll.Success, KVPoll.Failed) and recv.poll() in (KVPoll.Success, KVPoll.Failed)
        )
    )
    assert send.states[:2] == [KVPoll.Bootstrapping, KVPoll.WaitingForInput], send.states
    assert send.states[-1] == recv.states[-1] == KVPoll.Success, (send.side.failed, recv.side.failed)
    assert sorted(send.states) == send.states and sorted(recv.states) == recv.states
    after = node["d"].snapshot()
    for i, buf in enumerate(node["p"].bufs):
        np.testing.assert_array_equal(after[i][dst], buf[src[3:]])  # the delta landed in order
        untouched = np.setdiff1d(np.arange(PAGES), dst)
        np.testing.assert_array_equal(after[i][untouched], before[i][untouched])  # nothing else
    np.testing.assert_array_equal(after[-1][3], node["p"].aux[5])
    assert np.array_equal(np.delete(after[-1], 3, 0), np.delete(before[-1], 3, 0))
    m = send.side.get_transfer_metric()
    assert m.transfer_total_bytes == num_pages * ITEM * 2 * LAYERS + AUX_ROW


def test_decode_abort_mid_transfer_fails_both_and_writes_nothing_after(node) -> None:
    room = 8
    recv = KVServiceReceiver(node["md"], node["addr"], room)
    send = KVServiceSender(node["mp"], node["addr"], room)
    recv.init(0)
    recv.send_metadata(np.array([1, 2, 3, 4]), aux_index=0, decode_prefix_len=0)
    _until(lambda: send.poll() == KVPoll.WaitingForInput)
    send.init(4, aux_index=0)
    send.send(np.array([10, 11]))
    _until(lambda: recv.poll() == KVPoll.Transferring)
    recv.abort()
    assert recv.poll() == KVPoll.Failed
    with pytest.raises(KVServiceTransferError, match="aborted"):
        recv.failure_exception()
    time.sleep(0.3)  # the abort settles off-thread
    frozen = node["d"].snapshot()
    send.send(np.array([12, 13]))  # the prefill's next chunk: refused, the sender fails
    _until(lambda: send.poll() == KVPoll.Failed)
    with pytest.raises(KVServiceTransferError):
        send.failure_exception()
    for a, b in zip(node["d"].snapshot(), frozen, strict=True):
        np.testing.assert_array_equal(a, b)


def test_prefill_abort_fails_the_decode_side_too(node) -> None:
    room = 9
    recv = KVServiceReceiver(node["md"], node["addr"], room)
    send = KVServiceSender(node["mp"], node["addr"], room)
    recv.init(0)
    recv.send_metadata(np.array([5, 6]), aux_index=1, decode_prefix_len=0)
    _until(lambda: send.poll() == KVPoll.WaitingForInput)
    send.init(2, aux_index=1)
    send.send(np.array([30]))
    send.abort()
    assert send.poll() == KVPoll.Failed
    _until(lambda: recv.poll() == KVPoll.Failed)
    with pytest.raises(KVServiceTransferError):
        recv.failure_exception()


def test_a_refused_declaration_fails_the_prefill_at_once_with_the_reason(node) -> None:
    """The room goes to the prefill beside the ExpectDelta: when the decode's service refuses
    the declaration, the prefill (sending already) fails with its reason, not at its deadline."""
    room = 12
    recv = KVServiceReceiver(node["md"], node["addr"], room)
    send = KVServiceSender(node["mp"], node["addr"], room)
    recv.init(0)
    before = node["d"].snapshot()
    recv.send_metadata(np.array([1, PAGES + 3]), aux_index=0, decode_prefix_len=0)  # a page past the pool
    _until(lambda: send.poll() == KVPoll.WaitingForInput)
    t0 = time.monotonic()
    send.init(2, aux_index=0)
    send.send(np.array([3, 4]))
    _until(lambda: recv.poll() == KVPoll.Failed)
    assert "dst_page_indices" in recv.failed, recv.failed
    _until(lambda: send.poll() == KVPoll.Failed, 10)
    assert time.monotonic() - t0 < 10  # its deadline: 30 s (SGLANG_KVSERVICE_DEADLINE_MS unset)
    assert "refused the declaration" in send.failed and "dst_page_indices" in send.failed, send.failed
    for a, b in zip(node["d"].snapshot(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_dead_decode_peer_fails_the_sender_with_the_reason(node, monkeypatch) -> None:
    room = 10
    monkeypatch.setenv("SGLANG_KVSERVICE_PEER_ADDRESS", "127.0.0.1:1")  # nobody listens there
    monkeypatch.setenv("SGLANG_KVSERVICE_DEADLINE_MS", "3000")
    d2 = Pools(None)
    md2 = _manager(monkeypatch, DECODE, "decode", d2)
    try:
        recv = KVServiceReceiver(md2, node["addr"], room)
        send = KVServiceSender(node["mp"], node["addr"], room)
        recv.init(0)
        recv.send_metadata(np.array([1]), aux_index=0, decode_prefix_len=0)
        _until(lambda: send.poll() == KVPoll.WaitingForInput)
        send.init(1, aux_index=0)
        send.send(np.array([3]))
        _until(lambda: send.poll() == KVPoll.Failed, 20)
        with pytest.raises(KVServiceTransferError, match="127.0.0.1:1|UNAVAILABLE|unreachable"):
            send.failure_exception()
        _until(lambda: recv.poll() == KVPoll.Failed, 20)  # no sender came: its deadline
    finally:
        md2.close()
        d2.close()


def test_the_landing_option_lands_before_the_decode_allocates(node, monkeypatch) -> None:
    """SGLANG_KVSERVICE_LANDING_TTL_MS: init posts the room, the prefill sends and is done (LANDED)
    before the decode allocates; send_metadata claims the pages and the aux row into its allocation."""
    room, src, dst = 23, np.arange(20, 26), np.array([40, 12, 3, 7, 55, 61])
    d2 = Pools(None)
    md2 = _manager(monkeypatch, DECODE, "decode", d2, SGLANG_KVSERVICE_LANDING_TTL_MS="20000")
    try:
        assert md2.landing_ttl_ms == 20000
        recv = KVServiceReceiver(md2, node["addr"], room)
        send = KVServiceSender(node["mp"], node["addr"], room)
        before = d2.snapshot()
        recv.init(0)
        _until(lambda: send.poll() == KVPoll.WaitingForInput)  # the room is there before any allocation
        assert send.pop_decode_prefix_len() == 0
        send.init(src.size, aux_index=5)
        send.send(src[:2])
        send.send(src[2:])
        _until(lambda: send.poll() in (KVPoll.Success, KVPoll.Failed))
        assert send.poll() == KVPoll.Success, send.failed  # landed: the prefill's pages are free
        (st,) = md2.bg.call(md2.bg.kv.poll([f"sgl-{room}"]), 10)
        assert st.state == "LANDED", st
        recv.send_metadata(dst, aux_index=3, decode_prefix_len=0)
        _until(lambda: recv.poll() in (KVPoll.Success, KVPoll.Failed))
        assert recv.poll() == KVPoll.Success, recv.failed
        after = d2.snapshot()
        untouched = np.setdiff1d(np.arange(PAGES), dst)
        for i, buf in enumerate(node["p"].bufs):
            np.testing.assert_array_equal(after[i][dst], buf[src])
            np.testing.assert_array_equal(after[i][untouched], before[i][untouched])
        np.testing.assert_array_equal(after[-1][3], node["p"].aux[5])
        assert np.array_equal(np.delete(after[-1], 3, 0), np.delete(before[-1], 3, 0))
    finally:
        md2.close()
        d2.close()


def test_no_decode_instance_fails_the_sender_at_the_bootstrap_timeout(node) -> None:
    send = KVServiceSender(node["mp"], node["addr"], 11)
    node["mp"].bootstrap_timeout_s = 0.5
    _until(lambda: send.poll() == KVPoll.Failed, 10)
    with pytest.raises(KVServiceTransferError, match="no decode instance claimed bootstrap_room 11"):
        send.failure_exception()


def test_malloc_memory_is_refused_with_the_reason(monkeypatch) -> None:
    from kvservice_client import pointer_region

    plain = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ValueError, match="neither in a POSIX shared-memory object nor CUDA"):
        pointer_region(plain.ctypes.data, plain.nbytes)


def test_the_plugin_adds_the_backend_to_sglang() -> None:
    """In a fresh process, as SGLang does at start: load_plugins() finds the entry point; the CLI
    choice, the enum member and get_kv_class (also where imported by name) know kvservice."""
    code = """
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
from sglang.srt.disaggregation import utils
from sglang.srt.disaggregation.base.conn import KVArgs
b = utils.TransferBackend("kvservice")
assert "kvservice" in DISAGG_TRANSFER_BACKEND_CHOICES and utils.TransferBackend.KVSERVICE is b
names = [utils.get_kv_class(b, t).__name__ for t in (utils.KVClassType.MANAGER, utils.KVClassType.SENDER,
         utils.KVClassType.RECEIVER, utils.KVClassType.BOOTSTRAP_SERVER)]
assert utils.get_kv_class(b, utils.KVClassType.KVARGS) is KVArgs
from sglang.srt.managers import disagg_service
print(",".join(names), disagg_service.get_kv_class is utils.get_kv_class)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == [
        "KVServiceManager,KVServiceSender,KVServiceReceiver,KVServiceBootstrapServer",
        "True",
    ], r.stdout


def test_the_rest_of_the_base_class_surface(node) -> None:
    """What SGLang calls besides the transfer itself: registration, clear, the defaults it reads."""
    mp, md = node["mp"], node["md"]
    mp.register_to_bootstrap()  # nothing to announce: decode instances post rooms
    assert not mp.supports_role_switch and not mp.enable_deferred_decode_kv_release
    with pytest.raises(NotImplementedError):
        mp.teardown()  # role switch is not offered
    send = KVServiceSender(mp, node["addr"], 12)
    recv = KVServiceReceiver(md, node["addr"], 12)
    assert send.get_max_transfer_tokens() is None and send.should_send_kv_chunk(3, False)
    assert not send.should_send_kv_chunk(0, True)
    assert not recv.supports_host_destination
    recv.init(0)
    recv.send_metadata(np.array([1]), aux_index=0, decode_prefix_len=2)  # not page-aligned
    assert recv.poll() == KVPoll.Failed
    with pytest.raises(KVServiceTransferError, match="not a multiple of page_size"):
        recv.failure_exception()
    send.abort()
    send.clear()
    recv.clear()
    assert send.poll() == KVPoll.Failed


def _states_round_trip(mp: KVServiceManager, md: KVServiceManager, addr: str, p: Pools, d: Pools) -> None:
    room = 21
    before = [[t.copy() for t in comps] for comps in d.states]
    recv = KVServiceReceiver(md, addr, room)
    send = KVServiceSender(mp, addr, room)
    recv.init(0)
    recv.send_metadata(np.array([7, 8]), aux_index=1, state_indices=[[2], [30, 31]], decode_prefix_len=0)
    _until(lambda: send.poll() == KVPoll.WaitingForInput)
    send.init(2, aux_index=4)
    send.send(np.array([3]))  # first chunk: no state yet
    send.send(np.array([4]), state_indices=[[5], [11, 12]])  # last chunk with the state slots
    ends = (KVPoll.Success, KVPoll.Failed)
    _until(lambda: send.poll() in ends and recv.poll() in ends)
    assert (send.poll(), recv.poll()) == (KVPoll.Success, KVPoll.Success), (send.failed, recv.failed)
    for comp_p, comp_d, was in zip(p.states[0], d.states[0], before[0], strict=True):
        np.testing.assert_array_equal(comp_d[2], comp_p[5])  # mamba: slot 5 -> slot 2
        np.testing.assert_array_equal(np.delete(comp_d, 2, 0), np.delete(was, 2, 0))
    (swa_p,), (swa_d,), (swa_was,) = p.states[1], d.states[1], before[1]
    np.testing.assert_array_equal(swa_d[[30, 31]], swa_p[[11, 12]])  # window pages, in order
    np.testing.assert_array_equal(np.delete(swa_d, [30, 31], 0), np.delete(swa_was, [30, 31], 0))
    m = send.get_transfer_metric()
    assert m.transfer_total_bytes == 2 * ITEM * 2 * LAYERS + AUX_ROW + 96 + 40 + 2 * ITEM


def test_hybrid_model_state_buffers_move_slot_for_slot(monkeypatch) -> None:
    """Mamba (one slot per request, two component tensors) and SWA (window pages) state buffers:
    the decode side names its slots in send_metadata, the prefill its own with the last chunk;
    each component's rows land slot for slot, nothing else in the state buffers changes."""
    p_pools, d_pools = Pools(1, STATES), Pools(None, STATES)
    server = KVServiceBootstrapServer("127.0.0.1", 0)
    mp = _manager(monkeypatch, PREFILL, "prefill", p_pools, SGLANG_KVSERVICE_BOOTSTRAP_TIMEOUT_S="5")
    md = _manager(monkeypatch, DECODE, "decode", d_pools, SGLANG_KVSERVICE_DEADLINE_MS="8000")
    try:
        _states_round_trip(mp, md, f"127.0.0.1:{server.port}", p_pools, d_pools)
    finally:
        mp.close()
        md.close()
        server.close()
        p_pools.close()
        d_pools.close()


def test_state_types_that_are_not_whole_slots_are_refused_by_name(monkeypatch) -> None:
    pools = Pools(None, [("mamba", [(4, 16)]), ("dsa_tail", [(4, 16)])])
    try:
        with pytest.raises(ValueError, match=r"state_types\[1\]: 'dsa_tail'"):
            _manager(monkeypatch, DECODE, "decode", pools)
    finally:
        pools.close()


def test_state_slots_for_an_unregistered_state_fail_the_request(node) -> None:
    recv = KVServiceReceiver(node["md"], node["addr"], 22)
    recv.init(0)
    recv.send_metadata(np.array([1]), aux_index=0, state_indices=[[3]], decode_prefix_len=0)
    assert recv.poll() == KVPoll.Failed
    with pytest.raises(KVServiceTransferError, match=r"state_indices\[0\]"):
        recv.failure_exception()


def _assert_pages(got: MlaPools, dst: np.ndarray, want: MlaPools, src: np.ndarray) -> None:
    for g, w in zip(got.bufs, want.bufs, strict=True):  # (views end here: the pools can close)
        np.testing.assert_array_equal(g[dst], w[src])


def _tp2_room(monkeypatch, room: int, ranks: list, dpool, is_mla: bool, src, dst) -> None:
    """A prefill at attention TP 2 (``ranks``' pools, one manager each) into a TP-1 decode
    (``dpool``), in SGLang's order: both ranks read the room and send ``src``; both senders and
    the receiver reach Success."""
    monkeypatch.setenv("SGLANG_KVSERVICE_BOOTSTRAP_TIMEOUT_S", "5")
    server = KVServiceBootstrapServer("127.0.0.1", 0)
    addr = f"127.0.0.1:{server.port}"
    tp2 = types.SimpleNamespace(tp_size=2, dp_size=1, enable_dp_attention=False, pp_size=1)
    monkeypatch.setenv("SGLANG_KVSERVICE_ADDRESS", PREFILL)
    mps = [KVServiceManager(p.kv_args(rank), "prefill", tp2, is_mla) for rank, p in enumerate(ranks)]
    monkeypatch.setenv("SGLANG_KVSERVICE_ADDRESS", DECODE)
    md = KVServiceManager(dpool.kv_args(0), "decode", types.SimpleNamespace(tp_size=1), is_mla)
    try:
        recv = KVServiceReceiver(md, addr, room)
        sends = [KVServiceSender(m, addr, room) for m in mps]
        recv.init(0)
        _until(lambda: recv.poll() == KVPoll.WaitingForInput)
        recv.send_metadata(dst, aux_index=2, decode_prefix_len=0)
        for s in sends:
            _until(lambda s=s: s.poll() != KVPoll.Bootstrapping)
            assert s.poll() == KVPoll.WaitingForInput, s.failed
            s.init(len(src), aux_index=1)
            s.send(src)
        _until(lambda: all(s.poll() in (KVPoll.Success, KVPoll.Failed) for s in sends))
        _until(lambda: recv.poll() in (KVPoll.Success, KVPoll.Failed))
        assert [s.poll() for s in sends] == [KVPoll.Success] * 2, [s.failed for s in sends]
        assert recv.poll() == KVPoll.Success, recv.failed
    finally:
        for m in (*mps, md):
            m.close()
        server.close()


def test_mla_attention_tp2_prefill_to_tp1_decode_each_rank_sends(monkeypatch) -> None:
    """DeepSeek-style MLA at attention TP 2 on the prefill: both ranks hold a replica and both run
    SGLang's sender for the room; each registered as its attention TP rank, both reach Success
    and the decode's pages are replica 0's, whole (before, the two looked alike to the service
    and the room failed: "already has the plan")."""
    reps, dpool = [MlaPools(11), MlaPools(12)], MlaPools(None)
    try:
        src, dst = np.array([4, 9, 2]), np.array([30, 31, 7])
        _tp2_room(monkeypatch, 21, reps, dpool, True, src, dst)
        _assert_pages(dpool, dst, reps[0], src)  # replica 0's, whole
    finally:
        for p in (*reps, dpool):
            p.close()


class HeadPools:
    """MHA pools of ``heads`` KV heads of ``HEADS`` (one attention TP rank's), float16 in shm:
    K_0..K_{L-1}, V_0..V_{L-1} as ``[pages, page, heads, dim]``, one aux buffer."""

    def __init__(self, heads: int, seed: int | None) -> None:
        self.heads, self.item = heads, PAGE * heads * DIM * 2
        n = PAGES * self.item
        self.shm = shared_memory.SharedMemory(create=True, size=2 * LAYERS * n + AUX_ROWS * AUX_ROW)
        raw = np.frombuffer(self.shm.buf, dtype=np.uint8)
        if seed is not None:
            raw[:] = np.random.default_rng(seed).integers(0, 255, raw.size, dtype=np.uint8)
        self.raw = [raw[i * n : (i + 1) * n] for i in range(2 * LAYERS)]
        self.aux = raw[2 * LAYERS * n :].reshape(AUX_ROWS, AUX_ROW)

    def pages(self, i: int) -> np.ndarray:
        return self.raw[i].view(np.float16).reshape(PAGES, PAGE, self.heads, DIM)

    def kv_args(self, engine_rank: int) -> KVArgs:
        return _kv_args(engine_rank, self.raw, self.item, "torch.float16", self.heads, HEADS, self.aux)

    def close(self) -> None:
        del self.raw, self.aux
        self.shm.close()
        self.shm.unlink()


def _assert_heads(dec: HeadPools, dst: np.ndarray, ranks: list[HeadPools], src: np.ndarray) -> None:
    for i in range(2 * LAYERS):  # decode head r of each page is prefill rank r's one head
        got = dec.pages(i)[dst]
        for r, rank in enumerate(ranks):
            np.testing.assert_array_equal(got[:, :, r], rank.pages(i)[src][:, :, 0])


def test_mha_attention_tp2_prefill_to_tp1_decode_heads_from_each_rank(monkeypatch) -> None:
    """MHA at attention TP 2 on the prefill, one KV head a rank: both ranks read the room and send;
    the decode's pages hold head 0 from rank 0 and head 1 from rank 1, token for token."""
    ranks, dpool = [HeadPools(1, 21), HeadPools(1, 22)], HeadPools(HEADS, None)
    try:
        src, dst = np.array([8, 1, 5, 3]), np.array([2, 40, 41, 9])
        _tp2_room(monkeypatch, 22, ranks, dpool, False, src, dst)
        _assert_heads(dpool, dst, ranks, src)
    finally:
        for p in (*ranks, dpool):
            p.close()
