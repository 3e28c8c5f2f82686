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


LATENT = 96  # an MLA cache's latent row (kv_lora_rank + rope dims, small)


def _mla_cache(ws: WorkerSide) -> dict[str, torch.Tensor]:
    """An MLA model's caches as vLLM allocates them: [blocks, block_size, latent] per layer."""
    per_layer = BLOCKS * BLOCK * LATENT
    with ws.allocation_context():
        buf = torch.zeros(LAYERS * per_layer * 2, dtype=torch.int8)
    f = buf.view(torch.bfloat16)
    layers = [f[i * per_layer : (i + 1) * per_layer].view(BLOCKS, BLOCK, LATENT) for i in range(LAYERS)]
    return {f"layer.{i}": t for i, t in enumerate(layers)}


def _mla_transfer(tid: str, p_tp: int, d_tp: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Prefill ranks (MLA, TP ``p_tp``) send a request's 4 blocks to decode ranks (TP ``d_tp``).
    Each prefill rank's replica is filled with its own values, so a decode rank shows which one
    it was served by. Returns (each prefill rank's values, each decode rank's cache)."""
    src_blocks, dst_blocks = [5, 2, 9, 0], [3, 11, 7, 1]
    senders = [WorkerSide(ADDRESS, f"vllm-mla-p{r}", "p") for r in range(p_tp)]
    receivers = [WorkerSide(ADDRESS, f"vllm-mla-d{r}", "d") for r in range(d_tp)]
    values, dcaches = [], []
    try:
        for r, ws in enumerate(senders):
            cache = _mla_cache(ws)
            v = torch.randn(LAYERS, 4, BLOCK, LATENT).to(torch.bfloat16)
            for li, t in enumerate(cache.values()):
                t[src_blocks] = v[li]
            values.append(v)
            ws.register(cache, BLOCK, None, mla_tp=(p_tp, r))
            assert ws.layout is not None and ws.layout.kind == "mla" and ws.layout.tp_rank == r
        for r, ws in enumerate(receivers):
            dcaches.append(_mla_cache(ws))
            ws.register(dcaches[-1], BLOCK, None, mla_tp=(d_tp, r))
            ws.submit(KVServiceMeta(recvs=[RecvJob("d-1", tid, 0, tuple(dst_blocks), 10_000)]))
        for ws in senders:
            ws.submit(KVServiceMeta(sends=[SendJob("p-1", tid, tuple(src_blocks), ADDRESS, 10_000)]))
        done = _outcomes([*senders, *receivers], p_tp + d_tp)
        bad = [(o.job.transfer_id, type(o.job).__name__, o.why) for o in done if not o.ok]
        assert len(done) == p_tp + d_tp and not bad, (len(done), bad)
        got = [torch.stack([t[dst_blocks] for t in c.values()]) for c in dcaches]
        return values, got
    finally:
        for w in (*senders, *receivers):
            w.close()


def test_mla_tp2_prefill_fills_a_tp1_decode_rank_from_one_replica() -> None:
    """MLA caches are replicas: the decode rank's pages come whole from one prefill rank (rank 0,
    docs/decisions/0004), never a mix of the two; both prefill ranks end DONE."""
    values, (got,) = _mla_transfer("mla-21", 2, 1)
    assert torch.equal(got, values[0])
    assert not torch.equal(got, values[1])


def test_mla_tp2_to_tp2_spreads_over_the_replicas_and_tp1_to_tp2_fills_both() -> None:
    values, got = _mla_transfer("mla-22", 2, 2)
    assert torch.equal(got[0], values[0]) and torch.equal(got[1], values[1])  # receiver r <- sender r
    values, got = _mla_transfer("mla-12", 1, 2)
    assert torch.equal(got[0], values[0]) and torch.equal(got[1], values[0])
