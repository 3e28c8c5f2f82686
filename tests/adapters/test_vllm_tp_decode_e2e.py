"""Mixed TP the other way, real vLLM engines: a TP-1 prefill instance and a TP-2 decode instance
(two CPU worker processes, each expecting its head of every page), each beside its own kvservice;
the proxy flow of test_vllm_connector_e2e.

Asserts: the decode's two ranks registered one head each (``hnd_kv``, tp 0/2 and 1/2); its greedy
tokens from the moved cache equal its own alone (same TP, same numerics); the decode service
received both heads of each page once (the bytes of every page, in two halves); a second turn
moves only the pages past the decode's prefix-cache hit.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_pair import BLOCK, HEADS, PAGE_BYTES, layouts, prompt, tp2, vllm_pair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-tp-decode")
    yield from vllm_pair(d, ("prefill-tp1", "decode-tp2"), {}, tp2())


def test_tp1_prefill_tp2_decode_same_tokens_and_delta_only(tp_pair) -> None:
    p, d, svc_d = tp_pair["p"], tp_pair["d"], tp_pair["svc_d"]
    assert layouts(tp_pair["svc_p"], *HEADS) == [("hnd_kv", 2, 0, 1)]
    assert layouts(svc_d, *HEADS) == [("hnd_kv", 1, 0, 2), ("hnd_kv", 1, 1, 2)]
    a = prompt(150, 1)
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

    b = a + out["tokens"] + prompt(40, 2)
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
