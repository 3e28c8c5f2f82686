"""GPU: engine memory registered through CUDA IPC from another process (needs a CUDA GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
LAYOUT = dict(num_layers=3, page_size=16, num_pages=64, total_kv_heads=8, head_dim=128, dtype="bfloat16")


class Engine:
    def __init__(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [
                    str(HERE.parents[1]),
                    str(HERE.parents[1] / "clients/python"),
                    os.environ.get("PYTHONPATH", ""),
                ]
            ),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "gpu_engine.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def __call__(self, **cmd: object) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "engine process died"
        return json.loads(line)

    def close(self) -> None:
        try:
            self(op="stop")
        finally:
            self.proc.wait(30)


def test_service_writes_named_pages_of_an_engine_pool(server) -> None:
    """The service imports another process's tensors (one at a non-zero offset in a larger block),
    writes a pattern into named pages, and the engine sees exactly those pages changed."""
    eng = Engine()
    try:
        r = eng(op="register", address=server.address, layout=LAYOUT)
        assert r["k_offsets"][0] == 4096 and r["k_offsets"][1] > 4096
        bs = server.node.buffers.get(r["buffer_set_id"])
        assert bs.memory == "cuda_ipc"
        pb = bs.layout.page_bytes_k
        pages = [0, 5, 63]
        for layer in range(3):
            bs.k[layer].pages(pb)[pages] = 0xA5
        torch.cuda.synchronize()
        for layer in range(3):
            got = eng(op="check_fill", layer=layer, pages=pages, value=0xA5)
            assert got["named_ok"] and got["others_zero"], got
    finally:
        eng.close()
