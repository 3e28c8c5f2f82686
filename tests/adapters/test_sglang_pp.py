"""kvservice_sglang with pipeline parallelism: every rank of a PP-m x TP-a prefill and a PP-n x TP-b
decode is SGLang's backend classes (manager, sender, receiver, the prefill's bootstrap server)
driven in the order SGLang's schedulers call them, over real kvservice processes (one a node;
decode stages on two nodes where asked). Each rank's pools are SGLang-shaped (its stage's layers
only, its heads only, two metadata buffers) in POSIX shared memory; a prefill stage's KVArgs name
its ``prefill_start_layer`` as SGLang's prefill does, a decode stage's name none (its layers come
from the pools the plugin's hook saw made, as on a real decode).

SGLang's base classes come from the real package when it is installed, else from a stand-in;
``KVS_SGLANG_REAL=1`` requires the package (tests/adapters/test_sglang_backend.py runs this module
so in .venv-vllm, where the pinned sglang 0.5.23 is). A real SGLang server cannot run PP on CPU
(clients/sglang/README.md says why), hence the classes.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "sglang"))
from tests.support import sglang_stub
from tests.support.poll import eventually
from tests.support.services import ServiceProc

LAYERS, PAGE, HEADS, DIM, PAGES = 4, 4, 2, 16, 32
AUX = [(8, 16), (64, 16)]  # metadata buffers: (row bytes, rows)
PREFIX, PROMPT = 8, 40  # the decode holds 2 pages; the prompt is 10 pages
SRC = np.arange(10, 20)  # every prefill rank's pages of the prompt (SGLang allocates alike)
DST = np.array([30, 3, 17, 25, 9, 11, 2, 28])  # every decode rank's pages past its prefix
P_AUX, D_AUX = 5, 3  # the request's metadata row on each side


@pytest.fixture(scope="module")
def conn() -> Iterator[Any]:
    """kvservice_sglang.conn over the real SGLang, or over the stand-in (removed afterwards)."""
    with sglang_stub.backend_conn() as c:
        yield c


@pytest.fixture(scope="module")
def services() -> Iterator[list[ServiceProc]]:
    """Three kvservice processes: the prefill's node and two decode nodes."""
    procs = [ServiceProc(n) for n in ("pp-prefill", "pp-decode0", "pp-decode1")]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


class Model:
    """The request's KV as one unsplit instance would hold it: per layer K and V
    ``[pages, page, heads, dim]`` float16, and the metadata rows each prefill stage wrote."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.kv = rng.standard_normal((LAYERS, 2, PAGES, PAGE, HEADS, DIM)).astype(np.float16)
        self.aux = [[rng.integers(0, 255, (n, row), dtype=np.uint8) for row, n in AUX] for _ in range(LAYERS)]


class Rank:
    """One rank's pools in shm: K then V of ``layers`` (its ``heads`` of HEADS), the metadata buffers."""

    def __init__(self, layers: list[int], tp: tuple[int, int]) -> None:
        self.layers, self.tp = layers, tp
        self.heads = max(1, HEADS // tp[0])
        self.item = PAGE * self.heads * DIM * 2
        kv = 2 * len(layers) * PAGES * self.item
        self.shm = shared_memory.SharedMemory(create=True, size=kv + sum(r * n for r, n in AUX))
        raw = np.frombuffer(self.shm.buf, dtype=np.uint8)
        raw[:] = 0xEE  # nothing a transfer writes
        n = PAGES * self.item
        self.bufs = [raw[i * n : (i + 1) * n].reshape(PAGES, self.item) for i in range(2 * len(layers))]
        self.aux, off = [], kv
        for row, rows in AUX:
            self.aux.append(raw[off : off + row * rows].reshape(rows, row))
            off += row * rows

    def head_slice(self) -> slice:
        """This rank's KV heads of the model's (TP <= HEADS here)."""
        return slice(self.tp[1] * self.heads, (self.tp[1] + 1) * self.heads)

    def kv_view(self, i: int) -> np.ndarray:
        """Buffer ``i`` (K of layer index i, or V of i - len(layers)) as ``[pages, page, heads, dim]``."""
        return self.bufs[i].view(np.float16).reshape(PAGES, PAGE, self.heads, DIM)

    def fill(self, model: Model) -> None:
        """This rank's share of ``model``: its layers, its heads, its stage's metadata rows."""
        n = len(self.layers)
        for j, layer in enumerate(self.layers):
            self.kv_view(j)[:] = model.kv[layer, 0][:, :, self.head_slice()]
            self.kv_view(n + j)[:] = model.kv[layer, 1][:, :, self.head_slice()]
        for mine, theirs in zip(self.aux, model.aux[self.layers[0]], strict=True):
            mine[:] = theirs

    def kv_args(self, conn: Any, prefill: bool, pp_rank: int) -> Any:
        """SGLang's KVArgs of this rank: a prefill names its heads and first layer; a decode
        neither (SGLang 0.5.23's decode leaves them unset, and its dtype ``auto``)."""
        a = conn.KVArgs()
        a.engine_rank, a.gpu_id, a.page_size, a.pp_rank = self.tp[1], 0, PAGE, pp_rank
        a.kv_data_ptrs = [b.ctypes.data for b in self.bufs]
        a.kv_data_lens = [PAGES * self.item] * len(self.bufs)
        a.kv_item_lens = [self.item] * len(self.bufs)
        a.kv_layer_ids = []  # what SGLang gives for a plain MHA pool
        a.aux_data_ptrs = [x.ctypes.data for x in self.aux]
        a.aux_data_lens = [x.nbytes for x in self.aux]
        a.aux_item_lens = [x.shape[1] for x in self.aux]
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        if prefill:
            a.kv_cache_dtype_str = "torch.float16"
            a.kv_head_num, a.total_kv_head_num = self.heads, HEADS
            a.prefill_start_layer = self.layers[0]
        else:
            a.kv_cache_dtype_str = "auto"
            self._record_pool()
        return a

    def _record_pool(self) -> None:
        """What the plugin's hook notes of a decode pool SGLang made (``pools.record_pool``)."""
        import torch
        from kvservice_sglang.pools import record_pool

        n = len(self.layers)
        tensors = [torch.from_numpy(self.kv_view(i)) for i in range(2 * n)]
        pool = types.SimpleNamespace(
            head_num=self.heads, start_layer=self.layers[0], k_buffer=tensors[:n], v_buffer=tensors[n:]
        )
        record_pool(pool)

    def close(self) -> None:
        del self.bufs, self.aux
        self.shm.close()
        self.shm.unlink()


def stages(pp: int) -> list[list[int]]:
    """The model's layers of each of ``pp`` stages (SGLang's even split)."""
    per = LAYERS // pp
    return [list(range(s * per, (s + 1) * per)) for s in range(pp)]


class Shape(NamedTuple):
    prefill_pp: int
    prefill_tp: int
    decode_pp: int
    decode_tp: int
    decode_nodes: int  # decode stages spread over this many kvservice nodes


SHAPES = [
    Shape(2, 1, 1, 1, 1),  # PP 2 -> PP 1
    Shape(1, 1, 2, 1, 2),  # PP 1 -> PP 2, each decode stage on a node of its own
    Shape(2, 2, 1, 1, 1),  # TP 2 x PP 2 -> one rank: heads gathered per layer
    Shape(2, 1, 2, 2, 2),  # PP 2 -> TP 2 x PP 2: heads split per layer
    Shape(4, 1, 2, 1, 1),  # PP 4 -> PP 2
]


def _manager(conn: Any, monkeypatch: Any, address: str, mode: str, args: Any, pp: int, tp: int) -> Any:
    monkeypatch.setenv("SGLANG_KVSERVICE_ADDRESS", address)
    monkeypatch.setenv("SGLANG_KVSERVICE_PEER_ADDRESS", address)
    server_args = types.SimpleNamespace(pp_size=pp, tp_size=tp, dp_size=1, enable_dp_attention=False)
    return conn.KVServiceManager(args, mode, server_args, False)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: f"P{s.prefill_pp}x{s.prefill_tp}-D{s.decode_pp}x{s.decode_tp}"
)
def test_each_layer_reaches_the_stage_that_holds_it(conn, services, monkeypatch, shape: Shape) -> None:
    """A chunked room (decode prefix 2 pages) between a PP-m x TP-a prefill and a PP-n x TP-b
    decode: every rank Success, each decode rank's layers byte-exact (its heads of the model's
    K and V at its pages past the prefix, nothing else written), and its metadata rows those of
    the prefill stage holding the decode stage's first layer."""
    monkeypatch.setenv("SGLANG_KVSERVICE_BOOTSTRAP_TIMEOUT_S", "30")
    monkeypatch.setenv("SGLANG_KVSERVICE_DEADLINE_MS", "30000")
    room = 4800 + SHAPES.index(shape)
    model = Model(room)
    p_addr, d_addrs = services[0].address, [s.address for s in services[1 : 1 + shape.decode_nodes]]
    server = conn.KVServiceBootstrapServer("127.0.0.1", 0, peer_address=p_addr, pp_size=shape.prefill_pp)
    addr = f"127.0.0.1:{server.port}"
    p_ranks = [(s, Rank(layers, (shape.prefill_tp, r))) for s, layers in enumerate(stages(shape.prefill_pp))
               for r in range(shape.prefill_tp)]  # fmt: skip
    d_ranks = [(s, Rank(layers, (shape.decode_tp, r))) for s, layers in enumerate(stages(shape.decode_pp))
               for r in range(shape.decode_tp)]  # fmt: skip
    mgrs: list[Any] = []
    try:
        for _, rank in p_ranks:
            rank.fill(model)
        for s, rank in p_ranks:
            args = rank.kv_args(conn, True, s)
            mgrs.append(
                _manager(conn, monkeypatch, p_addr, "prefill", args, shape.prefill_pp, shape.prefill_tp)
            )
        p_mgrs = mgrs[:]
        for s, rank in d_ranks:
            node = d_addrs[s % len(d_addrs)]
            args = rank.kv_args(conn, False, s)
            mgrs.append(_manager(conn, monkeypatch, node, "decode", args, shape.decode_pp, shape.decode_tp))
        d_mgrs = mgrs[len(p_mgrs) :]
        for m, (_, rank) in zip(d_mgrs, d_ranks, strict=True):
            assert list(m.layer_ids) == rank.layers  # from the pools the hook saw made
        before = [[b.copy() for b in r.bufs] + [x.copy() for x in r.aux] for _, r in d_ranks]

        recvs = [conn.KVServiceReceiver(m, addr, room) for m in d_mgrs]
        sends = [conn.KVServiceSender(m, addr, room) for m in p_mgrs]
        for r in recvs:
            r.init(0)
            r.send_metadata(DST, aux_index=D_AUX, decode_prefix_len=PREFIX)
        num_pages = -(-(PROMPT - PREFIX) // PAGE)
        for s in sends:
            eventually(lambda s=s: s.poll() != conn.KVPoll.Bootstrapping, 30, "the decode stages posted")
            assert s.poll() == conn.KVPoll.WaitingForInput, s.failed
            assert s.pop_decode_prefix_len() == PREFIX
            s.init(num_pages, aux_index=P_AUX)
            s.send(SRC[2:6])  # chunked prefill: two chunks
            s.send(SRC[6:])
        ends = (conn.KVPoll.Success, conn.KVPoll.Failed)
        eventually(lambda: all(x.poll() in ends for x in (*sends, *recvs)), 60, "every rank ended")
        assert [s.poll() for s in sends] == [conn.KVPoll.Success] * len(sends), [s.failed for s in sends]
        assert [r.poll() for r in recvs] == [conn.KVPoll.Success] * len(recvs), [r.failed for r in recvs]

        for (stage, rank), old in zip(d_ranks, before, strict=True):
            _check(shape, model, stage, rank, old)
    finally:
        for m in mgrs:
            m.close()
        server.close()
        for _, rank in (*p_ranks, *d_ranks):
            rank.close()


def _check(shape: Shape, model: Model, stage: int, rank: Rank, old: list[np.ndarray]) -> None:
    """A decode rank's pools after the room (its views end here, so the pools can close)."""
    untouched = np.setdiff1d(np.arange(PAGES), DST)
    n = len(rank.layers)
    for j, layer in enumerate(rank.layers):
        for kv, i in ((0, j), (1, n + j)):
            want = model.kv[layer, kv][SRC[2:]][:, :, rank.head_slice()]
            np.testing.assert_array_equal(
                rank.kv_view(i)[DST], want, f"layer {layer} {'KV'[kv]} stage {stage}"
            )
            np.testing.assert_array_equal(rank.bufs[i][untouched], old[i][untouched])
    first = rank.layers[0]  # its metadata rows ride its first layer, from the stage holding it
    for x, theirs, was in zip(rank.aux, model.aux[_holder(shape, first)], old[2 * n :], strict=True):
        np.testing.assert_array_equal(x[D_AUX], theirs[P_AUX])
        np.testing.assert_array_equal(np.delete(x, D_AUX, 0), np.delete(was, D_AUX, 0))


def _holder(shape: Shape, layer: int) -> int:
    """The first layer of the prefill stage that holds ``layer`` (its metadata rows' key in Model)."""
    return next(s for s in stages(shape.prefill_pp) if layer in s)[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pp_prefill_fails_a_room_declared_whole(conn, services, monkeypatch) -> None:
    """A PP-2 prefill whose bootstrap server does not say so (``pp_size=1``): the decode declares
    one transfer of every layer, and each prefill stage fails the room, saying why; so does the
    decode, once the prefill aborted."""
    monkeypatch.setenv("SGLANG_KVSERVICE_BOOTSTRAP_TIMEOUT_S", "10")
    monkeypatch.setenv("SGLANG_KVSERVICE_DEADLINE_MS", "10000")
    room, model = 4890, Model(1)
    p_addr, d_addr = services[0].address, services[1].address
    server = conn.KVServiceBootstrapServer("127.0.0.1", 0, peer_address=p_addr, pp_size=1)
    addr = f"127.0.0.1:{server.port}"
    p_ranks = [(s, Rank(layers, (1, 0))) for s, layers in enumerate(stages(2))]
    d_rank = Rank(list(range(LAYERS)), (1, 0))
    mgrs: list[Any] = []
    try:
        for s, rank in p_ranks:
            rank.fill(model)
            mgrs.append(_manager(conn, monkeypatch, p_addr, "prefill", rank.kv_args(conn, True, s), 2, 1))
        md = _manager(conn, monkeypatch, d_addr, "decode", d_rank.kv_args(conn, False, 0), 1, 1)
        mgrs.append(md)
        recv = conn.KVServiceReceiver(md, addr, room)
        sends = [conn.KVServiceSender(m, addr, room) for m in mgrs[:2]]
        recv.init(0)
        recv.send_metadata(DST, aux_index=D_AUX, decode_prefix_len=PREFIX)
        for s in sends:
            eventually(lambda s=s: s.poll() != conn.KVPoll.Bootstrapping, 30, "the decode posted")
            s.init(8, aux_index=P_AUX)
            s.send(SRC[2:])
            assert s.poll() == conn.KVPoll.Failed
            with pytest.raises(conn.KVServiceTransferError, match="one transfer of every layer"):
                s.failure_exception()
        eventually(lambda: recv.poll() == conn.KVPoll.Failed, 30, "the decode's room failed")
    finally:
        for m in mgrs:
            m.close()
        server.close()
        for _, rank in p_ranks:
            rank.close()
        d_rank.close()
