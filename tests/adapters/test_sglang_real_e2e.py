"""Real SGLang 0.5.23 servers on CPU (.venv-sglang) on our backend: a prefill and a decode server
with ``--disaggregation-transfer-backend kvservice``, each beside its own kvservice process, and
one server without disaggregation, the reference. Requests go to both halves of the pair at
once, as sglang-router sends them.

Asserts: greedy tokens through the pair equal the single server's, token for token (several
requests at once); the first token's logprobs, which reach the decode only in SGLang's metadata
buffers (our aux rows), equal the single server's, and the service received exactly one row of
each buffer; a second turn of a conversation moves only the pages past the decode's radix-cache
hit (the services' counters: pages sent vs skipped); a request aborted at the decode fails, its
prefill half fails, and both servers go on serving; a killed prefill kvservice fails the request
in flight, and once it is back the servers serve again through it.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kvservice_client import Layout

from tests.support.services import MeteredService, admin_stats
from tests.support.sglang_servers import SglangServer, build_model, pd_generate, require_sglang

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RADIX = "--disaggregation-decode-enable-radix-cache"
DEADLINE_MS = "6000"  # a transfer whose peer died fails within this


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 13 + salt * 97) % 1000 + 3 for i in range(n)]


def _greedy(ids: list[int], n: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}, **extra}


def _failed(out: dict[str, Any]) -> str:
    """Why a request failed ("" if it did not): SGLang ends it aborted, or answers an error."""
    reason = out.get("meta_info", {}).get("finish_reason") or {}
    if reason.get("type") == "abort":
        return str(reason.get("message", "abort"))
    return str(out.get("error", "")) if out.get("http_status", 200) >= 400 else ""


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_sglang()
    d = tmp_path_factory.mktemp("sglang-e2e")
    build_model(d / "model")
    # the service's defaults (integrity off: the cross-node lane carries the transfers; with it on
    # they take the gRPC route, which every other end-to-end test checks with integrity)
    svc_p, svc_d = (
        MeteredService("sgl-prefill", integrity=False),
        MeteredService("sgl-decode", integrity=False),
    )
    env = {"SGLANG_KVSERVICE_DEADLINE_MS": DEADLINE_MS}
    started = time.monotonic()
    made: list[SglangServer] = []
    try:
        svc_p.wait_ready()
        svc_d.wait_ready()
        made += [
            SglangServer(d / "model", d / "single.log"),
            SglangServer(d / "model", d / "prefill.log", "prefill", svc_p.address, env=env),
            SglangServer(d / "model", d / "decode.log", "decode", svc_d.address, RADIX, env=env),
        ]
        for s in made:
            s.ready()
        print(f"three SGLang servers up in {time.monotonic() - started:.0f} s")
        yield {"single": made[0], "p": made[1], "d": made[2], "svc_p": svc_p, "svc_d": svc_d}
    finally:
        with ThreadPoolExecutor(max(1, len(made))) as pool:  # each drains for seconds: all at once
            list(pool.map(SglangServer.stop, made))
        svc_p.stop()
        svc_d.stop()


def test_greedy_tokens_through_the_pair_equal_one_server(servers) -> None:
    """Four requests at once through the pair: each one's tokens are the single server's."""
    p, d, single = servers["p"], servers["d"], servers["single"]
    prompts = [_prompt(n, salt) for n, salt in ((40, 1), (97, 2), (130, 3), (64, 4))]
    alone = [single.generate(_greedy(ids, 12))["output_ids"] for ids in prompts]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda ids: pd_generate(p, d, _greedy(ids, 12)), prompts))
    for out, want in zip(outs, alone, strict=True):
        assert out.get("output_ids") == want, out
        assert out["meta_info"]["finish_reason"]["type"] == "length", out


def test_the_pairs_transfers_take_the_cross_node_lane(servers) -> None:
    """SGLang's shape (chunks, aux rows on the last) between the pair's two services goes over the
    native cross-node lane on both sides once the prefill's service has its channel open (the
    services' route counters; the first request of a pair may take gRPC while it opens)."""
    p, d = servers["p"], servers["d"]
    svc_p, svc_d = servers["svc_p"], servers["svc_d"]
    pd_generate(p, d, _greedy(_prompt(40, 21), 2))  # (the prefill service's channel opens)
    before_d, before_p = svc_d.routes(), svc_p.routes("sender")
    for i in range(3):
        pd_generate(p, d, _greedy(_prompt(40 + i, 22 + i), 2))
    moved_d = _delta(svc_d.routes(), before_d)
    moved_p = _delta(svc_p.routes("sender"), before_p)
    print(f"routes: decode (receiver) {moved_d}, prefill (sender) {moved_p}")
    for moved in (moved_d, moved_p):
        assert moved["cross_node_lane"] == 3 and moved["grpc"] == 0 and moved["lane"] == 0, moved


def test_the_first_tokens_logprobs_arrive_in_the_aux_rows(servers) -> None:
    """The decode's first token and its logprobs come from the prefill's metadata rows: equal to
    the single server's, and the service received one row of each metadata buffer."""
    p, d, single, svc_d = servers["p"], servers["d"], servers["single"], servers["svc_d"]
    ids = _prompt(75, 5)
    body = _greedy(ids, 4, return_logprob=True, top_logprobs_num=3)
    want = single.generate(body)["meta_info"]
    before = svc_d.moved()
    got = pd_generate(p, d, body)
    moved = _delta(svc_d.moved(), before)
    first, ref = got["meta_info"]["output_token_logprobs"][0], want["output_token_logprobs"][0]
    assert first[1] == ref[1] == got["prefill"]["output_ids"][0], (first, ref)
    assert first[0] == pytest.approx(ref[0], abs=1e-4), (first, ref)
    top, ref_top = got["meta_info"]["output_top_logprobs"][0], want["output_top_logprobs"][0]
    assert [t[1] for t in top] == [t[1] for t in ref_top], (top, ref_top)
    assert [t[0] for t in top] == pytest.approx([t[0] for t in ref_top], abs=1e-4)
    (bs,) = admin_stats(svc_d.address).buffer_sets
    page_bytes = Layout.from_proto(bs.layout).page_bytes_all_layers
    assert moved["pages_sent"] == len(ids), moved  # page size 1: a page a token
    # one row of each metadata buffer, whatever the prompt's length (SGLang's MetadataBuffers:
    # output ids, cached tokens, logprobs, top logprobs, top-k, hidden state, bootstrap room)
    aux = moved["bytes"] - len(ids) * page_bytes
    shorter = _prompt(20, 12)
    before = svc_d.moved()
    pd_generate(p, d, _greedy(shorter, 2))
    again = _delta(svc_d.moved(), before)
    assert aux > 0 and again["bytes"] - len(shorter) * page_bytes == aux, (moved, again, page_bytes)


def test_a_second_turn_moves_only_the_pages_past_the_decode_radix_hit(servers) -> None:
    """Turn 2 of a conversation: the decode's radix cache holds turn 1, so the prefill sends only
    the pages past that hit (SGLang's decode_prefix_len): both services count exactly those as
    sent and none skipped (nothing below the hit is even offered); tokens equal one server's."""
    p, d, single = servers["p"], servers["d"], servers["single"]
    svc_p, svc_d = servers["svc_p"], servers["svc_d"]
    turn1 = _prompt(90, 6)
    out1 = pd_generate(p, d, _greedy(turn1, 8))
    turn2 = turn1 + out1["output_ids"] + _prompt(30, 7)
    before_d, before_p = svc_d.moved(), svc_p.moved("sender")
    out2 = pd_generate(p, d, _greedy(turn2, 8))
    moved_d, moved_p = _delta(svc_d.moved(), before_d), _delta(svc_p.moved("sender"), before_p)
    assert out2["output_ids"] == single.generate(_greedy(turn2, 8))["output_ids"]
    hit = int(out2["meta_info"]["cached_tokens"])  # the decode's radix-cache hit, in tokens
    assert len(turn1) <= hit < len(turn2), out2["meta_info"]
    for moved in (moved_d, moved_p):
        assert moved["pages_sent"] == len(turn2) - hit, (moved, hit)  # page size 1
        assert moved["pages_skipped"] == 0 and moved["skipped_bytes"] == 0, (moved, hit)


def test_an_aborted_request_fails_alone_and_both_servers_serve_on(servers) -> None:
    """The decode half waits for its prefill; aborted there, it ends aborted, its late prefill
    half fails instead of hanging, and the next request is served right."""
    p, d, single = servers["p"], servers["d"], servers["single"]
    ids = _prompt(60, 8)
    room = 7_000_001
    body = {
        **_greedy(ids, 8),
        "rid": "kvs-abort-me",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": room,
    }
    with ThreadPoolExecutor(2) as pool:
        dec = pool.submit(d.generate, body, 60)
        time.sleep(2)  # the decode declared the transfer and posted the room
        d.abort("kvs-abort-me")
        out = dec.result()
        assert "abort" in _failed(out), out
        started = time.monotonic()
        pre = p.generate(body, 60)  # the prefill half of the aborted room
        assert time.monotonic() - started < 20, pre
        assert _failed(pre), pre
    assert p.alive() and d.alive()
    again = _prompt(50, 9)
    assert (
        pd_generate(p, d, _greedy(again, 6))["output_ids"] == single.generate(_greedy(again, 6))["output_ids"]
    )


def test_a_killed_prefill_service_fails_that_request_and_the_pair_serves_once_it_is_back(servers) -> None:
    """The prefill's kvservice dies while a request waits on it: that request fails within the
    deadline; both servers stay up; once the service is back the pair serves right again."""
    p, d, single, svc_p = servers["p"], servers["d"], servers["single"], servers["svc_p"]
    ids = _prompt(70, 10)
    room = 7_000_002
    body = {**_greedy(ids, 6), "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port}
    body["bootstrap_room"] = room
    with ThreadPoolExecutor(2) as pool:
        dec = pool.submit(d.generate, body, 90)
        time.sleep(2)  # the decode declared the transfer: the prefill's half meets a dead service
        svc_p.kill()
        started = time.monotonic()
        pre = pool.submit(p.generate, body, 90)
        out = dec.result()
        assert time.monotonic() - started < int(DEADLINE_MS) / 1000 + 10, out  # its deadline
        pre_out = pre.result()  # the client's reconnect and open timeouts (5 s + 10 s)
        assert time.monotonic() - started < 40, pre_out
    assert _failed(out), out
    assert _failed(pre_out), pre_out
    assert p.alive() and d.alive()
    svc_p.proc = svc_p._start()  # the same service back on its socket (a restarted sidecar)
    svc_p.wait_ready()
    again = _prompt(55, 11)
    want = single.generate(_greedy(again, 6))["output_ids"]
    assert pd_generate(p, d, _greedy(again, 6))["output_ids"] == want
    assert os.path.exists(svc_p.sock)


def test_the_sglang_bench_measures_the_pair_against_one_server(servers, monkeypatch) -> None:
    """bench_adapter_sglang_e2e's phase on these servers (two conversations of two turns at once):
    every request answered, tokens equal to the single server's, and each one's time and the time
    the pair added recorded (the bench's figures, at CI size, against real servers)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    bench = importlib.import_module("bench_adapter_sglang_e2e")

    p, d, single = servers["p"], servers["d"], servers["single"]
    prompts = bench.reference_prompts(single, 2, 2, 4)
    assert prompts[0][1][: len(prompts[0][0])] == prompts[0][0]  # turn 2 extends turn 1's history
    s = bench.summary(bench.phase(single, p, d, prompts, 4, 2))
    assert s["failures"] == [] and s["mismatches"] == [] and s["all_equal_to_single"], s
    assert s["pair"]["n"] == s["added"]["n"] == 4 and s["pair"]["p50_ms"] > 0, s
