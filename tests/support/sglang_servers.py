"""Real SGLang 0.5.23 servers on CPU (``.venv-sglang``, scripts/setup-sglang-cpu.sh) for the
end-to-end tests: one process tree a server, started with our launcher
(``python -m kvservice_sglang.launch_server``), driven over its HTTP API.

A P/D request is what sglang-router sends: the same ``/generate`` body, with the prefill's
``bootstrap_host`` / ``bootstrap_port`` and one ``bootstrap_room``, to the prefill and the decode
at once; the decode's answer is the request's (the prefill's is its one token).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.poll import eventually

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PY = ROOT / os.environ.get("SGLANG_VENV", ".venv-sglang") / "bin" / "python"
BUILD_MODEL = ROOT / "clients" / "vllm" / "e2e" / "vllm_instance.py"  # its "build": a tiny Llama

__all__ = ["SGLANG_PY", "SglangServer", "build_model", "pd_generate", "require_sglang"]

# SGLang's CPU engine without GPU kernels: torch-native attention and sampling, no
# overlap scheduler, no CUDA graphs; one float32 model, a small pool
_CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--disable-overlap-schedule", "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled", "--dtype", "float32", "--max-total-tokens", "4096",
    "--mem-fraction-static", "0.05", "--skip-server-warmup",
)  # fmt: skip


_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    # the registry imports only the Llama module (tools/sglang-cpu-site), not all 150-odd models
    "SGLANG_EXTERNAL_MODEL_PACKAGE": "sglang_cpu_models",
    "OMP_NUM_THREADS": "1",  # three servers share two cores
}


def require_sglang() -> None:
    """Skip without the SGLang venv; under CI=true its absence fails the test."""
    if not SGLANG_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{SGLANG_PY} missing: CI must run scripts/setup-sglang-cpu.sh")
        pytest.skip(f"{SGLANG_PY} missing (scripts/setup-sglang-cpu.sh)")


def build_model(path: Path) -> None:
    """A tiny random 2-layer Llama with a locally trained tokenizer (vllm_instance.py's build)."""
    subprocess.run([str(SGLANG_PY), str(BUILD_MODEL), "build", str(path)], check=True, capture_output=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SglangServer:
    """One ``sglang`` server process tree (``mode``: "null", "prefill" or "decode"); with a
    ``kvservice`` address, its transfer backend is kvservice on that service; ``backend`` names
    another of SGLang's (``mooncake``, ``nixl``: bench/bench_adapter_sglang_e2e.py)."""

    def __init__(
        self,
        model: Path,
        log: Path,
        mode: str = "null",
        kvservice: str = "",
        *extra: str,
        env: dict[str, str] | None = None,
        backend: str = "kvservice",
    ) -> None:
        self.port = _free_port()
        self.bootstrap_port = _free_port() if mode == "prefill" else 0
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(SGLANG_PY), "-m", "kvservice_sglang.launch_server", "--model-path", str(model)]
        argv += [*_CPU_FLAGS, "--host", "127.0.0.1", "--port", str(self.port)]
        if mode != "null":
            argv += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend]
        if mode == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if mode == "decode":  # its retraction backup on CPU (the default needs CUDA)
            argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        env = dict(os.environ, **_ENV, **(env or {}))
        if kvservice:
            env |= {"SGLANG_KVSERVICE_ADDRESS": kvservice, "SGLANG_KVSERVICE_PEER_ADDRESS": kvservice}
        self.logpath = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [*argv, *extra], stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def ready(self, timeout: float = 240.0) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang server exited {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        try:
            eventually(up, timeout, "the sglang server's health", interval=1)
        except AssertionError:
            raise RuntimeError(f"sglang server not up within {timeout}s: {self.tail()}") from None

    def tail(self, n: int = 6000) -> str:
        self._log.flush()
        return self.logpath.read_text(errors="replace")[-n:]

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def generate(self, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.url}/generate", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:  # SGLang answers a failed request with its reason
            return {"http_status": exc.code, "error": exc.read().decode(errors="replace")}

    def abort(self, rid: str) -> None:
        data = json.dumps({"rid": rid}).encode()
        req = urllib.request.Request(
            f"{self.url}/abort_request", data=data, headers={"Content-Type": "application/json"}
        )
        urllib.request.urlopen(req, timeout=10).read()

    def pids(self) -> list[int]:
        """The server's processes (its session), for the shared memory they leave behind."""
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()] or [self.proc.pid]

    def stop(self) -> None:
        pids = self.pids()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with _suppress():
            os.killpg(self.proc.pid, signal.SIGKILL)  # a child that outlived the launcher
        self._log.close()
        _remove_shm(pids)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)


def _remove_shm(pids: list[int]) -> None:
    """The shared-memory pools a server killed before its exit handlers left (kvservice_sglang.pools)."""
    for pid in pids:
        for path in Path("/dev/shm").glob(f"kvs-sglang-{pid}-*"):
            path.unlink(missing_ok=True)


def pd_generate(
    prefill: SglangServer,
    decode: SglangServer,
    body: dict[str, Any],
    room: int | None = None,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """One request through the pair, as sglang-router sends it: the decode's answer, with the
    prefill's under ``"prefill"``."""
    room = random.getrandbits(62) if room is None else room
    pd = {
        **body,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.generate, pd, timeout)
        d = pool.submit(decode.generate, pd, timeout)
        out = d.result()
        out["prefill"] = p.result()
    return out
