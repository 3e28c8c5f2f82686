"""Layer-wise streaming on the worker side against a real kvservice (KVS_TEST_SERVICE, started by
tests/adapters/test_vllm_connector_units.py): a prefill worker sends each layer's pages as that
layer is "computed" (save_layer), over two engine steps, to a decode worker that declared one load
per layer past its prefix hit; the decode cache then holds exactly the prefill's pages."""

from __future__ import annotations

import os
import time

import pytest
import torch
from kvservice_vllm.meta import KVServiceMeta, RecvJob, SendJob, StreamChunk, StreamEnd
from kvservice_vllm.worker import KVHeads, WorkerSide

ADDRESS = os.environ.get("KVS_TEST_SERVICE", "")
needs_service = pytest.mark.skipif(not ADDRESS, reason="needs a kvservice (KVS_TEST_SERVICE)")

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 3, 2, 64, 32, 12
HEADS_OF = KVHeads(total=HEADS, local=HEADS, head_dim=DIM)


def _caches(ws: WorkerSide) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: one int8 buffer allocated inside the hook, a view per layer."""
    per_layer = BLOCKS * HEADS * BLOCK * 2 * DIM
    with ws.allocation_context():
        buf = torch.zeros(LAYERS * per_layer * 4, dtype=torch.int8)
    f = buf.view(torch.float32)
    return {
        f"model.layers.{i}.self_attn.attn": f[i * per_layer : (i + 1) * per_layer].view(
            BLOCKS, HEADS, BLOCK, 2 * DIM
        )
        for i in range(LAYERS)
    }


def _outcomes(workers: list[WorkerSide], want: int, timeout: float = 20.0) -> list:
    got: list = []
    end = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < end:
        for w in workers:
            got += w.outcomes()
        time.sleep(0.01)
    return got


def _pair() -> tuple[WorkerSide, WorkerSide, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    p, d = WorkerSide(ADDRESS, "vllm-lw-p", "p"), WorkerSide(ADDRESS, "vllm-lw-d", "d")
    pc, dc = _caches(p), _caches(d)
    for c in pc.values():
        c.copy_(torch.randn_like(c))
    p.register(pc, BLOCK, HEADS_OF)
    d.register(dc, BLOCK, HEADS_OF)
    assert p.layer_sets is not None and len(p.layer_sets.buffer_sets) == LAYERS
    return p, d, pc, dc


def _step(p: WorkerSide, chunks: list[StreamChunk], layers: range) -> KVServiceMeta:
    meta = KVServiceMeta(chunks=chunks)
    for name in list(p.layer_sets.names)[layers.start : layers.stop]:  # type: ignore[union-attr]
        p.save_layer(name, meta)
    return meta


@needs_service
def test_layers_stream_over_two_steps_into_the_pages_past_the_decode_prefix() -> None:
    """Step 1 completes pages 0-1 (chunk 0), step 2 the rest (last): each layer's pages go as
    that layer is computed; the decode's 4 blocks past its 1-page prefix hold the prefill's
    bytes in every layer, its prefix block is untouched, both sides end ok."""
    p, d, pc, dc = _pair()
    try:
        src, dst = [5, 2, 9, 0, 7], [3, 11, 6, 1, 4]  # prompt pages 0..4; decode holds page 0
        d.submit(KVServiceMeta(recvs=[RecvJob("d-1", "lw-1", 1, tuple(dst[1:]), 10_000, layerwise=True)]))
        c1 = StreamChunk("p-1", "lw-1", 0, tuple(src[:2]), False, ADDRESS, 10_000)
        c2 = StreamChunk("p-1", "lw-1", 2, tuple(src[2:]), True, ADDRESS, 10_000)
        _step(p, [c1], range(LAYERS))
        p.end_step(_step(p, [c2], range(LAYERS - 1)))  # the last layer's hook "skipped": end_step sends it
        p.submit(KVServiceMeta(stream_ends=[StreamEnd("p-1", "lw-1")]))
        done = _outcomes([p, d], 2)
        assert len(done) == 2 and all(o.ok for o in done), done
        for name in pc:
            assert torch.equal(dc[name][dst[1:]], pc[name][src[1:]]), name
            assert not dc[name][dst[0]].any(), "the decode's prefix page was written"
    finally:
        p.close()
        d.close()


@needs_service
def test_a_stream_ending_early_fails_the_load_and_writes_nothing_after_it() -> None:
    """The prefill request ends after its first step (StreamEnd with a reason): every layer
    transfer is aborted, the decode's load fails, no page past the first chunk arrives."""
    p, d, pc, dc = _pair()
    try:
        src, dst = [5, 2, 9, 0], [3, 11, 6, 1]
        d.submit(KVServiceMeta(recvs=[RecvJob("d-2", "lw-2", 0, tuple(dst), 10_000, layerwise=True)]))
        _step(p, [StreamChunk("p-2", "lw-2", 0, tuple(src[:2]), False, ADDRESS, 10_000)], range(LAYERS))
        p.submit(KVServiceMeta(stream_ends=[StreamEnd("p-2", "lw-2", "aborted by the client")]))
        done = {o.job.req_id: o for o in _outcomes([p, d], 2)}
        assert set(done) == {"p-2", "d-2"} and not done["d-2"].ok and not done["p-2"].ok, done
        for name in dc:
            assert not dc[name][dst[2:]].any(), name
    finally:
        p.close()
        d.close()


# -- pipeline parallelism: each stage holds a layer range --------------------------------------
def _stage(ws: WorkerSide, layers: range) -> dict[str, torch.Tensor]:
    """A PP stage's caches: only its layers, named as vLLM names them (the model's numbers)."""
    per_layer = BLOCKS * HEADS * BLOCK * 2 * DIM
    with ws.allocation_context():
        buf = torch.zeros(len(layers) * per_layer * 4, dtype=torch.int8)
    f = buf.view(torch.float32)
    return {
        f"model.layers.{n}.self_attn.attn": f[i * per_layer : (i + 1) * per_layer].view(
            BLOCKS, HEADS, BLOCK, 2 * DIM
        )
        for i, n in enumerate(layers)
    }


def _pp_transfer(tid: str, p_stages: list[range], d_stages: list[range], stream: bool) -> None:
    """A prefill of PP len(p_stages) fills a decode of PP len(d_stages), 4 layers in all: every
    layer lands in the decode stage holding it, byte for byte, past a 1-page prefix hit."""
    senders = [WorkerSide(ADDRESS, f"vllm-pp-p{i}", "p") for i in range(len(p_stages))]
    receivers = [WorkerSide(ADDRESS, f"vllm-pp-d{i}", "d") for i in range(len(d_stages))]
    src, dst = [5, 2, 9, 0], [3, 11, 6, 1]
    try:
        pc: dict[str, torch.Tensor] = {}
        for ws, layers in zip(senders, p_stages, strict=True):
            c = _stage(ws, layers)
            for t in c.values():
                t.copy_(torch.randn_like(t))
            ws.register(c, BLOCK, HEADS_OF)
            pc.update(c)
        dc: dict[str, torch.Tensor] = {}
        for ws, layers in zip(receivers, d_stages, strict=True):
            c = _stage(ws, layers)
            ws.register(c, BLOCK, HEADS_OF)
            dc.update(c)
            ws.submit(KVServiceMeta(recvs=[RecvJob("d", tid, 1, tuple(dst[1:]), 10_000, layerwise=True)]))
        for ws in senders:  # every stage gets the same step metadata, as vLLM's workers do
            if stream:
                chunk = StreamChunk("p", tid, 0, tuple(src), True, ADDRESS, 10_000)
                ws.end_step(_step(ws, [chunk], range(0)))
                ws.submit(KVServiceMeta(stream_ends=[StreamEnd("p", tid)]))
            else:
                ws.submit(
                    KVServiceMeta(sends=[SendJob("p", tid, tuple(src), ADDRESS, 10_000, layerwise=True)])
                )
        done = _outcomes([*senders, *receivers], len(senders) + len(receivers))
        assert len(done) == len(senders) + len(receivers) and all(o.ok for o in done), done
        assert set(dc) == set(pc)
        for name in pc:
            assert torch.equal(dc[name][dst[1:]], pc[name][src[1:]]), name
            assert not dc[name][dst[0]].any(), name
    finally:
        for w in (*senders, *receivers):
            w.close()


@needs_service
@pytest.mark.parametrize("stream", [False, True])
def test_pp2_prefill_fills_a_pp1_decode(stream: bool) -> None:
    _pp_transfer(f"pp21-{stream}", [range(0, 2), range(2, 4)], [range(0, 4)], stream)


@needs_service
def test_pp1_prefill_fills_a_pp2_decode_and_pp2_an_uneven_pp3() -> None:
    _pp_transfer("pp12", [range(0, 4)], [range(0, 2), range(2, 4)], False)
    _pp_transfer("pp23", [range(0, 2), range(2, 4)], [range(0, 1), range(1, 3), range(3, 4)], True)


def test_layer_ids_are_the_models_layer_numbers() -> None:
    """A PP stage's layer names give the model's numbers; names without one fall back to order."""
    from kvservice_vllm.layers import layer_ids

    assert layer_ids(["model.layers.12.self_attn.attn", "model.layers.13.self_attn.attn"]) == [12, 13]
    assert layer_ids(["language_model.model.layers.3.attn"]) == [3]
    assert layer_ids(["a", "b"]) == [0, 1]
