"""MLA with tensor parallelism, real vLLM engines: a TP-2 prefill instance of a tiny DeepSeek-V3
(two CPU worker processes, each holding a replica of the latent cache and registering it as its TP
rank) and a TP-1 decode instance, each beside its own kvservice; the proxy flow of
test_vllm_connector_e2e, on vLLM's reference CPU MLA backend.

Asserts: each prefill rank registered an MLA buffer set as its rank (0/2, 1/2) and the decode rank
one of TP 1; the decode instance's greedy tokens from the moved cache equal its own alone; the
decode service received each page once (one replica served it: docs/decisions/0004) and the prefill
service counts the other replica's pages as skipped, not sent. (vLLM turns prefix caching off for
MLA on CPU, so a later turn moves its whole prompt again: delta-only turns are test_vllm_tp_e2e's.)

The reference is the decode instance alone, not the prefill's: this random model's top logits
nearly tie, and TP 2's all-reduce order flips them against TP 1's (measured: prefill alone
[618, 618, 512, 512, 512, 512], decode alone and decode from the moved cache both
[618, 618, 618, 618, 512, 512]). A cache that arrived wrong gives other tokens than the decode's.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_pair import layouts, prompt, tp2, vllm_pair

BLOCK = 16  # the CPU MLA backend's block
PAGE_BYTES = 2 * BLOCK * (512 + 64) * 4  # layers x tokens x latent row (kv_lora_rank + rope) x fp32
MLA = {"KVS_VLLM_MLA": "1", "KVS_VLLM_BLOCKS": "96"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def mla_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-mla")
    yield from vllm_pair(d, ("prefill-mla-tp2", "decode-mla-tp1"), tp2(**MLA), MLA, "build-mla")


def test_mla_tp2_prefill_tp1_decode_same_tokens_each_page_once(mla_pair) -> None:
    p, d, svc_p, svc_d = mla_pair["p"], mla_pair["d"], mla_pair["svc_p"], mla_pair["svc_d"]
    assert layouts(svc_p, "kind", "tp_rank", "tp_size") == [("mla", 0, 2), ("mla", 1, 2)]
    assert layouts(svc_d, "kind", "tp_rank", "tp_size") == [("mla", 0, 1)]
    for turn, n in enumerate((70, 45)):
        a = prompt(n, turn + 1)
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
