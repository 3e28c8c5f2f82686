"""Mixed TP with real vLLM engines: a TP-2 prefill instance (two CPU worker processes, each
registering its head of the cache with kvservice) and a TP-1 decode instance, each beside its own
kvservice; the proxy flow of test_vllm_connector_e2e.

Asserts: each worker rank registered its own head (``hnd_kv``, tp 0/2 and 1/2) and the decode
rank both heads; the decode instance's greedy tokens equal the prefill instance's alone; a second
turn moves only the pages past the decode's prefix-cache hit, both heads of each page once.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_pair import BLOCK, HEADS, PAGE_BYTES, layouts, prompt, tp2, vllm_pair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-tp")
    yield from vllm_pair(d, ("prefill-tp2", "decode-tp1"), tp2(), {})


def test_tp2_prefill_tp1_decode_same_tokens_and_delta_only(tp_pair) -> None:
    p, d, svc_d = tp_pair["p"], tp_pair["d"], tp_pair["svc_d"]
    assert layouts(tp_pair["svc_p"], *HEADS) == [("hnd_kv", 1, 0, 2), ("hnd_kv", 1, 1, 2)]
    assert layouts(svc_d, *HEADS) == [("hnd_kv", 2, 0, 1)]
    a = prompt(150, 1)
    alone = p.generate(a, 8)["tokens"]
    before = svc_d.moved()
    pre = p.generate(a, 1, {"do_remote_decode": True, "kvservice_peer": svc_d.address, "transfer_id": "tp-1"})
    out = d.generate(a, 8, pre["kv_transfer_params"])
    assert out["tokens"] == alone, (out, alone)
    moved = {k: svc_d.moved()[k] - before[k] for k in before}
    pages = -(-len(a) // BLOCK)
    assert moved["pages_sent"] == pages and moved["bytes"] == pages * PAGE_BYTES, moved  # both heads

    b = a + out["tokens"] + prompt(40, 2)
    alone2 = p.generate(b, 6)["tokens"]
    before = svc_d.moved()
    pre = p.generate(b, 1, {"do_remote_decode": True, "kvservice_peer": svc_d.address, "transfer_id": "tp-2"})
    out2 = d.generate(b, 6, pre["kv_transfer_params"])
    assert out2["tokens"] == alone2, (out2, alone2)
    moved2 = {k: svc_d.moved()[k] - before[k] for k in before}
    held = (len(a) + len(out["tokens"]) - 1) // BLOCK
    assert moved2["pages_skipped"] == held and moved2["pages_sent"] == -(-len(b) // BLOCK) - held, moved2
