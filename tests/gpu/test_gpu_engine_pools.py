"""GPU: vLLM- and SGLang-shaped CUDA pools, each in a process of its own and registered through
its adapter's own code (CUDA IPC), exchange KV byte-exact between two kvservice processes: across
engines, page sizes and page layouts (vLLM 0.32's LBNHC / LBHNC caches, FlashInfer's [blocks, 2,
...] NHD / HND, FlashAttention's K/V planes, SGLang's token pools), mixed TP 2->1 and 1->2, MLA.
The exchanges and the checks are tests/support/engine_pools.py's, which the CPU twin
(tests/adapters/test_engine_pools.py) runs on shared-memory pools.

    python -m pytest tests/gpu/test_gpu_engine_pools.py -v -p no:cacheprovider -o addopts=""
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.gpu import kvservice_procs

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "tests" / "support" / "engine_pools.py"
sys.path.insert(0, str(ROOT / "clients" / "vllm"))
sys.path.insert(0, str(ROOT / "clients" / "sglang"))
from tests.support.engine_pools import EXCHANGES, Spec, run_exchange  # noqa: E402

_PATH = os.pathsep.join(
    [
        str(ROOT),
        str(ROOT / "clients" / "python"),
        str(ROOT / "clients" / "vllm"),
        str(ROOT / "clients" / "sglang"),
        os.environ.get("PYTHONPATH", ""),
    ]
)


class PoolProc:
    """An engine_pools.EnginePool in a process of its own, on ``device``."""

    def __init__(self, spec: Spec, address: str, name: str, device: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": _PATH},
        )
        made = self._call(
            op="create", spec=dataclasses.asdict(spec), address=address, device=device, name=name
        )
        self.page_layout = made["page_layout"]

    def _call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"pool process died during {cmd['op']}"
        out: dict[str, Any] = json.loads(line)
        assert "error" not in out, out["error"]
        return out

    def fill(self, seed: int) -> None:
        self._call(op="fill", seed=seed)

    def digests(self, pages: list[int], lo: int, hi: int) -> Any:
        return self._call(op="digests", pages=pages, lo=lo, hi=hi)["result"]

    def expect(self, tid: str, prefix_pages: int, pages: list[int]) -> None:
        self._call(op="expect", tid=tid, prefix_pages=prefix_pages, pages=pages)

    def send(self, tid: str, pages: list[int], peer: str) -> None:
        self._call(op="send", tid=tid, pages=pages, peer=peer)

    def wait(self) -> dict[str, Any]:
        return self._call(op="wait")["result"]  # type: ignore[no-any-return]

    def close(self) -> None:
        try:
            self._call(op="stop")
        finally:
            self.proc.wait(30)


@pytest.fixture(params=["auto", "off"], ids=["same-host-fused", "transport"])
def services(request: Any, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Two kvservice processes on this GPU host; same_host_route 'auto' copies pool to pool over
    CUDA IPC (FUSED), 'off' packs, writes over NIXL and unpacks."""
    procs, socks = kvservice_procs(
        tmp_path, ("a", "b"), KVSERVICE_SAME_HOST_ROUTE=request.param, PYTHONPATH=_PATH
    )
    yield socks
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(20)


@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_gpu_engine_pools_exchange_kv_byte_exact(services, name: str) -> None:  # type: ignore[no-untyped-def]
    a, b = services
    dst_device = os.environ.get("KVS_TEST_DST_DEVICE", "cuda:0")  # e.g. cuda:1 on a two-GPU host

    def make(spec: Spec, address: str, pool_name: str) -> PoolProc:
        return PoolProc(spec, address, pool_name, "cuda:0" if address == a else dst_device)

    run_exchange(make, name, a, b, b)
