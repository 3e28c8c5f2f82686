"""What a P/D pair costs a request on SGLang, in one run: one SGLang server alone (the reference)
and a prefill/decode pair on each transfer backend, ours (``kvservice``, a kvservice process
beside each server) and SGLang's own ``mooncake`` (its TCP transport) and ``nixl`` (UCX), fed the
same tiny model and the same multi-turn conversations (real sglang 0.5.23 on CPU, .venv-sglang).

    .venv/bin/python bench/bench_adapter_sglang_e2e.py --out /tmp/adapter_sglang_e2e.json

The prompts are fixed before any pair starts: each conversation's turns follow the single
server's greedy answers (``max_new_tokens`` each), so every setup sees the same prompts. One phase
per backend, one pair up at a time beside the single server (~3.7 GB a server): the single
server's cache is flushed, the pair starts, then turn by turn all conversations go at once
(``--concurrency`` in flight) to the single server and to the pair, who goes first alternating by
turn. A pair's request is what sglang-router sends: the same ``/generate`` to the prefill and the
decode at once; its time is the decode's answer, end to end.

Per backend: the pair's and the single server's end-to-end time per request (p50/mean), the time
the pair adds per request over the single server (same prompt, same phase), when the prefill half
answered and how long the decode took after it (``after_prefill_half``), and whether its greedy
tokens equal the single server's, token for token (every mismatch listed). A backend that does not
start or fails requests says why in ``results[<backend>]["error"]`` / ``["failures"]``.
``--decode-radix`` runs every pair's decode with SGLang's decode radix cache (later turns then
move only the pages past the decode's hit); every server runs with ``--sleep-on-idle`` (below;
``--busy-idle``: without). Goal (reported, not asserted): kvservice adds no
more than the mooncake and nixl pairs, tokens equal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.services import MeteredService  # noqa: E402
from tests.support.sglang_servers import SGLANG_PY, SglangServer, build_model, pd_generate  # noqa: E402

BACKENDS = ("kvservice", "mooncake", "nixl")
RADIX = "--disaggregation-decode-enable-radix-cache"
# NOTE: an SGLang scheduler polls its sockets in a busy loop unless told to sleep when idle: three
# servers on two cores then keep both busy with no request running, and every figure measures that
# contention (a first run here: the single server 114-470 ms a request depending on the pair beside
# it). With it, an idle server waits on its sockets (zmq poll) and wakes on a request; a server with
# a transfer pending still polls, as in production. Every server here gets the same flags.
SLEEP_ON_IDLE = "--sleep-on-idle"
PAIR_TIMEOUT_S = 60.0  # a half not answered by then fails its request
# SGLang's mooncake backend on a host without RDMA: the transfer engine's TCP transport
MOONCAKE_TCP = {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}
# what each backend's transfer engine needs to import in .venv-sglang
IMPORTS = {
    "kvservice": "import kvservice_sglang.conn",
    "mooncake": "import mooncake.engine",
    "nixl": "import nixl._api",
}


def _conversation(i: int, turns: int) -> list[list[int]]:
    """User messages of conversation i (token ids); turn t's prompt = history + message t."""
    return [
        [(j * 7 + i * 131 + t * 17) % 1000 + 3 for j in range(150 if t == 0 else 48)] for t in range(turns)
    ]


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def _ms(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {
        "n": len(xs),
        "p50_ms": round(statistics.median(xs) * 1e3, 2),
        "p99_ms": round(_pct(xs, 99) * 1e3, 2),
        "mean_ms": round(statistics.fmean(xs) * 1e3, 2),
    }


def _greedy(ids: list[int], n: int) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}


def _failed(out: dict[str, Any]) -> str:
    """Why a request failed ("" if it did not): SGLang ends it aborted, or answers an error."""
    reason = out.get("meta_info", {}).get("finish_reason") or {}
    if reason.get("type") == "abort":
        return str(reason.get("message", "abort"))[:300]
    if out.get("http_status", 200) >= 400:
        return f"HTTP {out['http_status']}: {str(out.get('error', ''))[:300]}"
    return "" if "output_ids" in out else f"no output_ids: {str(out)[:300]}"


def _flush(server: SglangServer) -> None:
    """Empty the server's radix cache (SGLang's /flush_cache), so each phase starts cold."""
    req = urllib.request.Request(f"{server.url}/flush_cache", data=b"", method="POST")
    urllib.request.urlopen(req, timeout=30).read()


def _importable(backend: str) -> str:
    """ "" when the backend's transfer engine imports in .venv-sglang, else the error's last line."""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    r = subprocess.run(
        [str(SGLANG_PY), "-c", IMPORTS[backend]], capture_output=True, text=True, timeout=300, env=env
    )
    return "" if r.returncode == 0 else ((r.stderr.strip().splitlines() or ["?"])[-1])


class Pair:
    """A prefill and a decode server on one transfer backend: "kvservice" (a kvservice process
    beside each), "mooncake" (TCP) or "nixl"."""

    def __init__(self, backend: str, model: Path, logs: Path, flags: tuple[str, ...], radix: bool) -> None:
        self.backend = backend
        self.services: list[MeteredService] = []
        addr_p = addr_d = ""
        env = MOONCAKE_TCP if backend == "mooncake" else {}
        if backend == "kvservice":
            # integrity=None: the service's default, as in production
            self.services = [
                MeteredService("sgl-bench-p", integrity=None),
                MeteredService("sgl-bench-d", integrity=None),
            ]
            for s in self.services:
                s.wait_ready()
            addr_p, addr_d = self.services[0].address, self.services[1].address
        extra = (*flags, RADIX) if radix else flags
        self.p = SglangServer(
            model, logs / f"{backend}-prefill.log", "prefill", addr_p, *flags, env=env, backend=backend
        )
        self.d = SglangServer(
            model, logs / f"{backend}-decode.log", "decode", addr_d, *extra, env=env, backend=backend
        )

    def ready(self) -> None:
        self.p.ready()
        self.d.ready()

    def stop(self) -> None:
        with ThreadPoolExecutor(2) as pool:  # each drains for seconds: both at once
            list(pool.map(SglangServer.stop, (self.p, self.d)))
        for s in self.services:
            s.stop()


def _pd_timed(p: SglangServer, d: SglangServer, body: dict[str, Any]) -> dict[str, Any]:
    """pd_generate's request (both halves at once, one room), each half's answer timed from the
    send: the decode's answer, ``wall_s`` its time, its prefill half's under ``"prefill"``."""
    room = random.getrandbits(62)
    pd = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": room}
    t0 = time.monotonic()

    def half(server: SglangServer) -> dict[str, Any]:
        out = server.generate(pd, PAIR_TIMEOUT_S)
        out["wall_s"] = time.monotonic() - t0
        return out

    with ThreadPoolExecutor(2) as pool:
        pre, dec = pool.submit(half, p), pool.submit(half, d)
        out = dec.result()
        out["prefill"] = pre.result()
    return out


def _timed(send: Any, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    out = send(body)
    out["wall_s"] = time.monotonic() - t0
    return out


def reference_prompts(single: SglangServer, conversations: int, turns: int, n: int) -> list[list[list[int]]]:
    """Every conversation's prompts, turn by turn, the history following the single server's
    greedy answers (one request at a time)."""
    out = []
    for i in range(conversations):
        history: list[int] = []
        prompts = []
        for msg in _conversation(i, turns):
            prompt = history + msg
            answer = single.generate(_greedy(prompt, n))
            if _failed(answer):
                raise RuntimeError(f"the single server failed a reference request: {_failed(answer)}")
            prompts.append(prompt)
            history = prompt + answer["output_ids"]
        out.append(prompts)
    return out


def phase(
    single: SglangServer,
    p: SglangServer,
    d: SglangServer,
    prompts: list[list[list[int]]],
    n: int,
    concurrency: int,
) -> list[dict[str, Any]]:
    """Turn by turn, every conversation's request to the single server and through the pair
    (``concurrency`` in flight), who goes first alternating by turn: one row per request."""
    rows = []
    with ThreadPoolExecutor(concurrency) as pool:
        for t in range(len(prompts[0])):
            bodies = [_greedy(conv[t], n) for conv in prompts]
            got: dict[str, list[dict[str, Any]]] = {}
            order = ("single", "pair") if t % 2 == 0 else ("pair", "single")
            for who in order:
                if who == "single":
                    got[who] = list(pool.map(lambda b: _timed(single.generate, b), bodies))
                else:
                    got[who] = list(pool.map(lambda b: _pd_timed(p, d, b), bodies))
            for i, (ref, out) in enumerate(zip(got["single"], got["pair"], strict=True)):
                failed = _failed(out) or (_failed(out["prefill"]) and f"prefill: {_failed(out['prefill'])}")
                want, have = ref.get("output_ids", []), out.get("output_ids", [])
                rows.append(
                    {
                        "conversation": i,
                        "turn": t,
                        "prompt_tokens": len(prompts[i][t]),
                        "single_s": ref["wall_s"],
                        "pair_s": out["wall_s"],
                        "prefill_half_s": out["prefill"]["wall_s"],
                        "added_s": out["wall_s"] - ref["wall_s"],
                        "failed": failed or _failed(ref) and f"single: {_failed(ref)}",
                        "equal_to_single": not failed and have == want,
                        "single_ids": want,
                        "pair_ids": have,
                        "decode_cached_tokens": out.get("meta_info", {}).get("cached_tokens"),
                    }
                )
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A backend's figures over its phase's requests; failed requests are counted, not timed."""
    ok = [r for r in rows if not r["failed"]]
    mismatches = [
        {
            "conversation": r["conversation"],
            "turn": r["turn"],
            "first_difference_at": next(
                (k for k, (a, b) in enumerate(zip(r["single_ids"], r["pair_ids"], strict=False)) if a != b),
                min(len(r["single_ids"]), len(r["pair_ids"])),
            ),
            "single_ids": r["single_ids"],
            "pair_ids": r["pair_ids"],
        }
        for r in ok
        if not r["equal_to_single"]
    ]
    return {
        "requests": len(rows),
        "all_equal_to_single": bool(rows) and all(r["equal_to_single"] for r in rows),
        "mismatches": mismatches,
        "failures": [
            {"conversation": r["conversation"], "turn": r["turn"], "why": r["failed"]}
            for r in rows
            if r["failed"]
        ],
        "single": _ms([r["single_s"] for r in ok]),
        "pair": _ms([r["pair_s"] for r in ok]),
        "added": _ms([r["added_s"] for r in ok]),
        "prefill_half": _ms([r["prefill_half_s"] for r in ok]),
        "after_prefill_half": _ms([r["pair_s"] - r["prefill_half_s"] for r in ok]),
        "added_first_turn": _ms([r["added_s"] for r in ok if r["turn"] == 0]),
        "added_later_turns": _ms([r["added_s"] for r in ok if r["turn"] > 0]),
    }


def run(a: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    """The prompts from the single server, then one phase per backend, each pair beside it alone."""
    results: dict[str, Any] = {"notes": []}
    requests: dict[str, list[dict[str, Any]]] = {}
    flags = () if a.busy_idle else (SLEEP_ON_IDLE,)
    single = SglangServer(model, logs / "single.log", "null", "", *flags)
    try:
        single.ready()
        single.generate(_greedy([(i * 13) % 997 + 3 for i in range(100)], a.max_new_tokens))  # warm
        prompts = reference_prompts(single, a.conversations, a.turns, a.max_new_tokens)
        for backend in [b for b in a.backends.split(",") if b]:
            why = _importable(backend)
            if why:
                results[backend] = {
                    "error": f"not run: its transfer engine does not import in .venv-sglang ({why})"
                }
                continue
            _flush(single)
            t0 = time.monotonic()
            pair = Pair(backend, model, logs, flags, a.decode_radix)
            try:
                pair.ready()
                warm = pd_generate(pair.p, pair.d, _greedy([(i * 29) % 991 + 3 for i in range(90)], 2))
                if _failed(warm):
                    raise RuntimeError(f"the warm-up request failed: {_failed(warm)}")
                results[backend] = {"startup_s": round(time.monotonic() - t0, 1)}
                rows = phase(single, pair.p, pair.d, prompts, a.max_new_tokens, a.concurrency)
                requests[backend] = rows
                results[backend].update(summary(rows))
            except Exception as exc:  # noqa: BLE001 -- a backend that cannot run says why, the rest go on
                tails = {s.logpath.name: s.tail(1500) for s in (pair.p, pair.d)}
                results[backend] = {"error": f"{type(exc).__name__}: {str(exc)[:1500]}", "log_tails": tails}
            finally:
                pair.stop()
    finally:
        single.stop()
    return {"results": results, "requests": requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight (0: one a conversation)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--decode-radix", action="store_true", help=f"every decode server with {RADIX}")
    ap.add_argument("--busy-idle", action="store_true", help=f"servers without {SLEEP_ON_IDLE}")
    ap.add_argument("--small", action="store_true", help="CI size: 2 conversations x 2 turns, 4 tokens")
    ap.add_argument("--logs", default="", help="keep the servers' logs in this folder")
    ap.add_argument("--out", default="", help="a JSON file, or a folder to write adapter_sglang_e2e.json in")
    a = ap.parse_args()
    if a.small:
        a.conversations, a.turns, a.max_new_tokens = 2, 2, 4
    a.concurrency = a.concurrency or a.conversations
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as d:
        model = Path(d) / "model"
        build_model(model)
        logs = Path(a.logs) if a.logs else Path(d)  # a failed backend's log tails go in the JSON
        logs.mkdir(parents=True, exist_ok=True)
        body = run(a, model, logs)
    res = {
        "benchmark": "adapter_sglang_e2e",
        "command": "python " + " ".join(["bench/bench_adapter_sglang_e2e.py", *sys.argv[1:]]),
        "model": "random Llama, 2 layers, hidden 256, 2 KV heads x 64, fp32; page 1 (SGLang's CPU default)",
        "engine": "sglang 0.5.23 on CPU (torch_native attention), one OpenMP thread a server",
        "conversations": a.conversations,
        "turns": a.turns,
        "concurrency": a.concurrency,
        "max_new_tokens": a.max_new_tokens,
        "decode_radix_cache": a.decode_radix,
        "sleep_on_idle": not a.busy_idle,
        **body,
        "logs": a.logs or None,
        "meta": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "unix_time": int(time.time()),
            "argv": sys.argv,
        },
    }
    text = json.dumps(res, indent=2)
    print(json.dumps(res["results"], indent=2))
    if a.out:
        out = Path(a.out)
        if out.is_dir():
            out = out / "adapter_sglang_e2e.json"
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
