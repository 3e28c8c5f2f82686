"""Engine-shaped KV pools, registered through each adapter's own code, read back per token.

A pool is built as the engine builds its own (shapes, strides, allocation), on the CPU (POSIX
shared memory, as the adapters allocate it there) or on CUDA (registered through CUDA IPC):

    vllm   nhc / hnc      vLLM 0.32 GPU backends: one int8 allocation, per layer [blocks, heads,
                          bs, K|V] over memory in LBNHC / LBHNC order (layers outermost)
           planes_nhd     FlashAttention before 0.32: [2, blocks, bs, heads, dim] K/V planes
           planes_hnd     the same, HND stride order
           fi_nhd / fi_hnd  FlashInfer before 0.32: [blocks, 2, bs, heads, dim], NHD / HND
           mla / mla4     an MLA cache [blocks, bs, 576] / vLLM 0.32's [blocks, 1, bs, 576]
    sglang mha            SGLang's MHA token pool: per layer k_buffer / v_buffer
                          [slots + page, heads, dim], one allocation each
           mla            its MLA pool: per layer [slots + page, 1, 576]

vLLM pools register through ``kvservice_vllm.worker.WorkerSide.register`` and move through its
``submit`` (SendJob / RecvJob); SGLang pools register through
``kvservice_sglang.regions.register_kv_args`` with the KVArgs SGLang fills from its pool
(``get_contiguous_buf_infos``). Neither engine package is imported.

Tokens are read back through each engine's own view of its cache (how its attention reads K and V),
written here independently of kvservice: ``digests`` hashes, per layer, K/V and local head, the
bytes of a run of the sequence's tokens.

Run as a process (``python engine_pools.py``), one JSON command a line on stdin, one JSON answer a
line on stdout: the GPU tests drive pools in processes of their own (CUDA IPC between processes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import types
from multiprocessing import shared_memory
from typing import Any

import torch
from kvservice_client import BackgroundClient
from kvservice_sglang.regions import register_kv_args
from kvservice_vllm.jobs import RecvJob, SendJob
from kvservice_vllm.layout import KVHeads
from kvservice_vllm.worker import WorkerSide

from tests.support.poll import eventually

LAYERS, HEADS, DIM, LATENT = 2, 4, 64, 576
DTYPE, READ = torch.bfloat16, torch.int16  # registered as bf16; read back as same-size ints (bits)
DEADLINE_MS = 20_000


@dataclasses.dataclass(frozen=True)
class Spec:
    engine: str  # "vllm" or "sglang"
    kind: str  # see the module doc
    page: int  # vLLM block size / SGLang page size (tokens)
    pages: int
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def mla(self) -> bool:
        return self.kind.startswith("mla")

    @property
    def heads(self) -> int:
        return 1 if self.mla else HEADS // self.tp_size

    @property
    def dim(self) -> int:
        return LATENT if self.mla else DIM


def _vllm_views(kind: str, mem: torch.Tensor, b: int, n: int, h: int) -> torch.Tensor:
    """One layer's cache tensor over ``mem`` (its bytes, any dtype), as vLLM views it."""
    d = DIM
    if kind == "nhc":
        return mem.view(b, n, h, 2 * d).permute(0, 2, 1, 3)
    if kind == "hnc":
        return mem.view(b, h, n, 2 * d)
    if kind == "planes_nhd":
        return mem.view(2, b, n, h, d)
    if kind == "planes_hnd":
        return mem.view(2, b, h, n, d).permute(0, 1, 3, 2, 4)
    if kind == "fi_nhd":
        return mem.view(b, 2, n, h, d)
    if kind == "fi_hnd":
        return mem.view(b, 2, h, n, d).permute(0, 1, 3, 2, 4)
    if kind == "mla":
        return mem.view(b, n, LATENT)
    if kind == "mla4":
        return mem.view(b, 1, n, LATENT)
    raise ValueError(f"unknown vLLM cache kind {kind!r}")


def _vllm_kv(kind: str, t: torch.Tensor) -> list[torch.Tensor]:
    """K and V (or the latent) of one layer as [blocks, bs, heads, dim], as vLLM's attention reads."""
    if kind in ("nhc", "hnc"):  # the GPU backends split each row: K then V
        rows = t.transpose(1, 2)
        return [rows[..., :DIM], rows[..., DIM:]]
    if kind.startswith("planes"):
        return [t[0], t[1]]
    if kind.startswith("fi_"):
        return [t[:, 0], t[:, 1]]
    if kind == "mla":
        return [t.unsqueeze(2)]
    return [t.transpose(1, 2)]  # mla4


def step(**jobs: list[Any]) -> Any:
    """A worker step's metadata (what vLLM's scheduler side hands over): every job list, empty
    unless given."""
    kinds = ("sends", "recvs", "aborts", "lands", "claims", "chunks", "stream_ends")
    return types.SimpleNamespace(**{k: jobs.get(k, []) for k in kinds})


class EnginePool:
    """One engine rank's pool on ``device``, registered with the kvservice at ``address``."""

    def __init__(self, spec: Spec, address: str, device: str, name: str) -> None:
        self.spec, self.device = spec, torch.device(device)
        self._shm: shared_memory.SharedMemory | None = None
        self.worker: WorkerSide | None = None
        self.bg: BackgroundClient | None = None
        if spec.engine == "vllm":
            self._vllm(address, name)
        else:
            self._sglang(address, name)

    # -- building and registering ----------------------------------------------------------------
    def _vllm(self, address: str, name: str) -> None:
        s = self.spec
        ws = self.worker = WorkerSide(address, name, name)
        per_layer = s.pages * s.page * s.heads * (s.dim if s.mla else 2 * s.dim) * 2  # bytes
        with ws.allocation_context():  # on the CPU: POSIX shared memory (the adapter's own hook)
            raw = torch.zeros(LAYERS * per_layer, dtype=torch.int8, device=self.device)
        self.raw = raw.view(torch.uint8)
        caches, self.reads = {}, []
        for layer in range(LAYERS):
            mem = raw[layer * per_layer : (layer + 1) * per_layer]
            caches[f"model.layers.{layer}.self_attn"] = _vllm_views(
                s.kind, mem.view(DTYPE), s.pages, s.page, s.heads
            )
            self.reads.append(_vllm_kv(s.kind, _vllm_views(s.kind, mem.view(READ), s.pages, s.page, s.heads)))
        heads = None if s.mla else KVHeads(HEADS, s.heads, DIM, s.tp_size, s.tp_rank)
        ws.register(caches, s.page, heads, cpu_attention=False)
        self.layout = ws.layout

    def _sglang(self, address: str, name: str) -> None:
        s = self.spec
        slots = s.pages * s.page  # SGLang allocates size + page_size slots (its padded slot 0 page)
        nbuf = LAYERS * (1 if s.mla else 2)
        buf_bytes = slots * s.heads * s.dim * 2
        if self.device.type == "cpu":  # host pools must be in /dev/shm for kvservice to map them
            self._shm = shared_memory.SharedMemory(create=True, size=nbuf * buf_bytes)
            flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
            bufs = [flat[i * buf_bytes : (i + 1) * buf_bytes] for i in range(nbuf)]
            self.raw = flat
        else:  # SGLang allocates each layer's buffer with torch.zeros of its own
            bufs = [torch.zeros(buf_bytes, dtype=torch.uint8, device=self.device) for _ in range(nbuf)]
            self.raw = None
        self._bufs = bufs
        pools = [b.view(DTYPE).view(slots, s.heads, s.dim) for b in bufs]
        reads = [b.view(READ).view(s.pages, s.page, s.heads, s.dim) for b in bufs]
        self.reads = [[reads[li]] if s.mla else [reads[li], reads[LAYERS + li]] for li in range(LAYERS)]
        args = types.SimpleNamespace(  # what SGLang's KVArgs holds for this pool
            engine_rank=s.tp_rank,
            gpu_id=self.device.index or 0,
            page_size=s.page,
            kv_data_ptrs=[p.data_ptr() for p in pools],
            kv_data_lens=[p.nbytes for p in pools],
            kv_item_lens=[p[0].nbytes * s.page for p in pools],
            kv_cache_dtype_str=str(DTYPE),
            kv_head_num=s.heads,
            total_kv_head_num=1 if s.mla else HEADS,
            aux_data_ptrs=[],
            aux_data_lens=[],
            aux_item_lens=[],
        )
        self.bg = BackgroundClient(address, client_name=name)
        reg, self.buffer_set_id = register_kv_args(self.bg, args, s.mla)
        self.layout = reg.layout

    # -- data ------------------------------------------------------------------------------------
    def fill(self, seed: int) -> None:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        targets = [self.raw] if self.raw is not None else self._bufs
        for t in targets:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, device=self.device, dtype=torch.uint8))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def digests(self, pages: list[int], lo: int, hi: int) -> list[list[list[str]]]:
        """Per layer, K/V (or latent), local head: sha256 of tokens ``[lo, hi)`` of the sequence
        held in ``pages`` (in order)."""
        out = []
        idx = torch.tensor(pages, device=self.device)
        for parts in self.reads:
            per_kv = []
            for t in parts:  # [pages, page, heads, dim]
                rows = t[idx].reshape(-1, t.shape[2], t.shape[3])[lo:hi]  # [tokens, heads, dim]
                per_kv.append(
                    [hashlib.sha256(rows[:, j].contiguous().cpu().numpy().tobytes()).hexdigest()[:20]
                     for j in range(rows.shape[1])]
                )  # fmt: skip
            out.append(per_kv)
        return out

    # -- transfers (the adapters' own calls) -----------------------------------------------------
    def expect(self, tid: str, prefix_pages: int, pages: list[int], sender: str = "") -> None:
        """ExpectDelta as the adapter declares it; ``sender``: the prefill's kvservice, if known."""
        if self.worker is not None:
            job = RecvJob(f"r-{tid}", tid, prefix_pages, tuple(pages), DEADLINE_MS, sender)
            self.worker.submit(step(recvs=[job]))  # type: ignore[arg-type]
            return
        assert self.bg is not None
        bs = self.buffer_set_id
        self._fut = self.bg.transfer(
            tid,
            lambda kv: kv.expect_delta(
                tid,
                bs,
                prefix_pages=prefix_pages,
                dst_page_indices=pages,
                deadline_ms=DEADLINE_MS,
                sender_address=sender,
            ),
            DEADLINE_MS,
        )

    def send(self, tid: str, pages: list[int], peer: str) -> None:
        if self.worker is not None:
            job = SendJob(f"s-{tid}", tid, tuple(pages), peer, DEADLINE_MS)
            self.worker.submit(step(sends=[job]))  # type: ignore[arg-type]
            return
        assert self.bg is not None
        bs = self.buffer_set_id
        self._fut = self.bg.transfer(
            tid,
            lambda kv: kv.send_delta(
                tid, bs, src_page_indices=pages, peer_address=peer, deadline_ms=DEADLINE_MS
            ),
            DEADLINE_MS,
        )

    def wait(self, timeout: float = 30.0) -> dict[str, Any]:
        """The transfer's end: {"ok": bool, "why": str}."""
        if self.worker is not None:
            try:
                got = eventually(self.worker.outcomes, timeout, "an outcome", interval=0.005)
            except AssertionError:
                return {"ok": False, "why": "no outcome"}
            return {"ok": got[0].ok, "why": got[0].why}
        st = self._fut.result(timeout)
        return {"ok": st.state == "DONE", "why": f"{st.state} {st.error}"}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.bg is not None:
            self.bg.close()
        if self._shm is not None:
            self._bufs = []
            self.reads = []
            self.raw = None
            self._shm.close()
            self._shm.unlink()


# -- one exchange, for the CPU and the GPU tests ---------------------------------------------------
TOKENS = 100  # the sequence (the last page of most page sizes partial)
PREFIX_TOKENS = 32  # the receiver's prefix-cache hit, rounded down to its pages: not sent

# name: (sender spec, sender TP size, receiver spec, receiver TP size); each rank's spec gets its
# tp_size / tp_rank filled in
EXCHANGES: dict[str, tuple[Spec, int, Spec, int]] = {
    "vllm-nhc16-to-sglang1": (Spec("vllm", "nhc", 16, 12), 1, Spec("sglang", "mha", 1, 160), 1),
    "sglang64-to-vllm-hnc16": (Spec("sglang", "mha", 64, 3), 1, Spec("vllm", "hnc", 16, 12), 1),
    "vllm-fi_nhd16-to-sglang16": (Spec("vllm", "fi_nhd", 16, 10), 1, Spec("sglang", "mha", 16, 9), 1),
    "sglang1-to-vllm-fi_hnd32": (Spec("sglang", "mha", 1, 130), 1, Spec("vllm", "fi_hnd", 32, 6), 1),
    "vllm-planes_hnd16-to-sglang64": (Spec("vllm", "planes_hnd", 16, 9), 1, Spec("sglang", "mha", 64, 3), 1),
    "sglang1-to-vllm-planes_nhd32": (Spec("sglang", "mha", 1, 130), 1, Spec("vllm", "planes_nhd", 32, 6), 1),
    "tp2to1-vllm-fi_nhd16-to-sglang1": (Spec("vllm", "fi_nhd", 16, 10), 2, Spec("sglang", "mha", 1, 150), 1),
    "tp1to2-sglang16-to-vllm-fi_hnd16": (Spec("sglang", "mha", 16, 9), 1, Spec("vllm", "fi_hnd", 16, 10), 2),
    "tp2to1-sglang1-to-vllm-nhc32": (Spec("sglang", "mha", 1, 140), 2, Spec("vllm", "nhc", 32, 6), 1),
    "tp1to2-vllm-hnc16-to-sglang64": (Spec("vllm", "hnc", 16, 10), 1, Spec("sglang", "mha", 64, 3), 2),
    "mla-vllm16-to-sglang1": (Spec("vllm", "mla", 16, 9), 1, Spec("sglang", "mla", 1, 140), 1),
    "mla-sglang64-to-vllm4-32": (Spec("sglang", "mla", 64, 3), 1, Spec("vllm", "mla4", 32, 6), 1),
}


def _ranks(spec: Spec, n: int) -> list[Spec]:
    return [dataclasses.replace(spec, tp_size=n, tp_rank=r) for r in range(n)]


def run_exchange(make: Any, name: str, src_address: str, dst_address: str, peer: str) -> None:
    """One transfer of the sequence from the sender ranks' pools into the receiver ranks' pools,
    each pool built by ``make(spec, address, name)`` (an EnginePool or a process driving one).

    Asserts: every transfer DONE; for every layer, K/V and global head, the receiver's tokens past
    its prefix hash as the sender rank's holding that head; the receiver's prefix is unchanged."""
    src, p, dst, d = EXCHANGES[name]
    senders: list[Any] = []
    receivers: list[Any] = []
    try:
        for s in _ranks(src, p):  # one at a time: whatever was made is closed if the next fails
            senders.append(make(s, src_address, f"{name}-src{s.tp_rank}"))
        for s in _ranks(dst, d):
            receivers.append(make(s, dst_address, f"{name}-dst{s.tp_rank}"))
        for i, pool in enumerate(senders + receivers):
            pool.fill(seed=11 + i)
        g = torch.Generator().manual_seed(len(name))
        src_pages = torch.randperm(src.pages, generator=g)[: -(-TOKENS // src.page)].tolist()
        dst_pages = torch.randperm(dst.pages, generator=g)[: -(-TOKENS // dst.page)].tolist()
        prefix = PREFIX_TOKENS // dst.page
        lo = prefix * dst.page
        held = [r.digests(dst_pages, 0, lo) for r in receivers]
        tid = f"x-{name}"
        for r in receivers:
            r.expect(tid, prefix, dst_pages[prefix:])
        for s in senders:
            s.send(tid, src_pages, peer)
        ends = [x.wait() for x in receivers + senders]
        assert all(e["ok"] for e in ends), ends
        want = [s.digests(src_pages, lo, TOKENS) for s in senders]  # [rank][layer][kv][local head]
        hs, hd = (1, 1) if src.mla else (HEADS // p, HEADS // d)
        for r, pool in enumerate(receivers):
            got = pool.digests(dst_pages, lo, TOKENS)
            for layer, parts in enumerate(got):
                for kv, heads in enumerate(parts):
                    for j, digest in enumerate(heads):
                        h = r * hd + j  # global head
                        assert digest == want[h // hs][layer][kv][h % hs], (
                            f"{name}: receiver rank {r} layer {layer} {'KV'[kv]} head {h} differs"
                        )
            assert pool.digests(dst_pages, 0, lo) == held[r], f"{name}: the receiver's prefix changed"
    finally:
        for pool in senders + receivers:
            pool.close()


def main() -> None:
    """A pool in a process of its own: {"op": "create", "spec": {...}, "address", "device", "name"}
    first, then fill / expect / send / wait / digests / layout; "stop" ends it."""
    pool: EnginePool | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op, out = cmd.pop("op"), {}
        try:
            if op == "create":
                if cmd["device"].startswith("cuda"):
                    torch.cuda.set_device(torch.device(cmd["device"]))
                pool = EnginePool(Spec(**cmd["spec"]), cmd["address"], cmd["device"], cmd["name"])
                out = {"page_layout": pool.layout.page_layout, "kind": pool.layout.kind}
            elif op == "stop":
                if pool is not None:
                    pool.close()
                print(json.dumps({"ok": True}), flush=True)
                return
            else:
                assert pool is not None
                out = {"result": getattr(pool, op)(**cmd)}
        except Exception as exc:  # the test reads the error
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
