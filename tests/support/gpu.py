"""GPU tests' engines and services: an engine process with VRAM pools (CUDA IPC handles), and
kvservice processes on Unix sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.support.poll import eventually

__all__ = ["LAYOUT", "Engine", "kvservice_procs", "wait_lanes"]

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = dict(num_layers=3, page_size=16, num_pages=64, total_kv_heads=8, head_dim=128, dtype="bfloat16")


class Engine:
    """An engine process (tests/gpu/gpu_engine.py) with VRAM pools, driven by JSON commands."""

    def __init__(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [
                    str(ROOT),
                    str(ROOT / "clients/python"),
                    os.environ.get("PYTHONPATH", ""),
                ]
            ),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "gpu" / "gpu_engine.py")],
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


def kvservice_procs(
    tmp: Path, names: tuple[str, ...], *, launcher: Sequence[str] = ("-m", "kvservice"), **env: str
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Start one kvservice process per name on a Unix socket under ``tmp`` (``env`` adds or
    overrides settings; end-to-end integrity is on, as in every test, unless ``env``
    says ``KVSERVICE_TRANSFER_INTEGRITY="0"``; ``launcher``: the interpreter's arguments in
    place of ``-m kvservice``, e.g. a fault-injecting script); return them and their addresses
    once every socket exists."""
    full = {
        **os.environ,
        "KVSERVICE_LOG_FORMAT": "text",
        "KVSERVICE_VRAM_STAGING_MB": "256",
        "KVSERVICE_TRANSFER_INTEGRITY": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "clients/python"), os.environ.get("PYTHONPATH", "")]
        ),
        **env,
    }
    procs, socks = [], []
    for name in names:
        sock = tmp / f"{name}.sock"
        procs.append(
            subprocess.Popen([sys.executable, *launcher, "--uds-path", str(sock)], cwd=ROOT, env=full)
        )
        socks.append(f"unix:{sock}")
    eventually(lambda: all(os.path.exists(s[5:]) for s in socks), 60, "the services to start", 0.1)
    return procs, socks


def wait_lanes(socks: Sequence[str], timeout: float = 180) -> None:
    """Every service's lane socket is there (the first start builds the native module)."""
    eventually(
        lambda: all(os.path.exists(s[5:] + ".lane") for s in socks), timeout, "the lanes to start", 0.1
    )
