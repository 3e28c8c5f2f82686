"""The worker side with mixed TP against a real kvservice (address in KVS_TEST_SERVICE, started by
tests/adapters/test_vllm_connector_units.py): two TP-2 prefill ranks send one request's blocks to a
TP-1 decode rank, every cache in vLLM's CPU layout allocated through the connector's shared-memory
hook; the decode cache then holds every head of every token, byte for byte."""

from __future__ import annotations

import os
import time

import pytest
import torch
from kvservice_vllm.meta import KVServiceMeta, RecvJob, SendJob
from kvservice_vllm.worker import KVHeads, WorkerSide

ADDRESS = os.environ.get("KVS_TEST_SERVICE", "")
pytestmark = pytest.mark.skipif(not ADDRESS, reason="needs a kvservice (KVS_TEST_SERVICE)")

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 2, 2, 64, 32, 12
T = 100  # tokens: 4 blocks, the last partial


def _caches(ws: WorkerSide, local_heads: int) -> dict[str, torch.Tensor]:
    """What vLLM's CPU backend allocates: one int8 buffer (inside the hook), per layer views."""
    per_layer = BLOCKS * local_heads * BLOCK * 2 * DIM
    with ws.allocation_context():
        buf = torch.zeros(LAYERS * per_layer * 4, dtype=torch.int8)
    f = buf.view(torch.float32)
    return {
        f"layer.{i}": f[i * per_layer : (i + 1) * per_layer].view(BLOCKS, local_heads, BLOCK, 2 * DIM)
        for i in range(LAYERS)
    }


def _write(cache: dict[str, torch.Tensor], blocks: list[int], kv: torch.Tensor, heads: list[int]) -> None:
    """kv: [layers, 2, tokens, all heads, dim] into ``blocks`` (prompt order) for ``heads``."""
    for li, t in enumerate(cache.values()):
        for i, b in enumerate(blocks):
            seg = kv[li, :, i * BLOCK : (i + 1) * BLOCK][:, :, heads]  # [2, n, h, dim]
            n = seg.shape[1]
            t[b, :, :n, :DIM] = seg[0].transpose(0, 1)
            t[b, :, :n, DIM:] = seg[1].transpose(0, 1)


def _read(cache: dict[str, torch.Tensor], blocks: list[int], tokens: int) -> torch.Tensor:
    out = []
    for t in cache.values():
        rows = torch.cat([t[b] for b in blocks], dim=1)[:, :tokens]  # [heads, tokens, 2*dim]
        out.append(torch.stack([rows[..., :DIM], rows[..., DIM:]]).transpose(1, 2))  # [2, tokens, heads, dim]
    return torch.stack(out)


def _outcomes(workers: list[WorkerSide], want: int, timeout: float = 20.0) -> list:
    got: list = []
    end = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < end:
        for w in workers:
            got += w.outcomes()
        time.sleep(0.01)
    return got


def test_tp2_prefill_ranks_fill_a_tp1_decode_rank() -> None:
    kv = torch.randn(LAYERS, 2, 4 * BLOCK, HEADS, DIM)
    senders = [WorkerSide(ADDRESS, f"vllm-p{r}", "p") for r in range(2)]
    receiver = WorkerSide(ADDRESS, "vllm-d", "d")
    try:
        src_blocks, dst_blocks = [5, 2, 9, 0], [3, 11, 7, 1]
        for r, ws in enumerate(senders):
            cache = _caches(ws, 1)
            _write(cache, src_blocks, kv, [r])
            ws.register(cache, BLOCK, KVHeads(total=HEADS, local=1, head_dim=DIM, tp_size=2, tp_rank=r))
            assert ws.layout is not None and ws.layout.page_layout == "hnd_kv" and ws.layout.tp_rank == r
        dcache = _caches(receiver, HEADS)
        receiver.register(dcache, BLOCK, KVHeads(total=HEADS, local=HEADS, head_dim=DIM))
        receiver.submit(KVServiceMeta(recvs=[RecvJob("d-1", "tp-x", 0, tuple(dst_blocks), 10_000)]))
        for ws in senders:
            ws.submit(KVServiceMeta(sends=[SendJob("p-1", "tp-x", tuple(src_blocks), ADDRESS, 10_000)]))
        done = _outcomes([*senders, receiver], 3)
        assert len(done) == 3 and all(o.ok for o in done), done
        got = _read(dcache, dst_blocks, T)
        assert torch.equal(got, kv[:, :, :T]), "the decode rank's tokens differ from the prefill ranks'"
    finally:
        for w in (*senders, receiver):
            w.close()
