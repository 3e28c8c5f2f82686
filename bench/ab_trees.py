"""A/B of bench_control or bench_transfer between two source trees, interleaved on one machine.

    python bench/ab_trees.py --base /tmp/base --new . --rounds 3 --what "..." \\
        --out /tmp/ab_plan_offer_cpu.json -- --cross-node --transfers 300 ...
    python bench/ab_trees.py --bench transfer ... -- --device cpu --cross-node --pages 1 ...

Each round runs ``bench_<bench>.py <args>`` in the base tree, then in the new tree (the services
each bench starts run that tree's code: the harness starts them from its own checkout). The
trees' bench/ should be the same files (copy the new ones into the base worktree) so only the
service code differs. Writes one JSON: every run's headline numbers and a per-side summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def headline(j: dict[str, Any]) -> dict[str, Any]:
    if j["benchmark"] == "transfer":  # SendDelta -> the receiver's DONE, per path
        return {
            path: {k: v[k] for k in ("p50_ms", "p99_ms", "phases_us_median") if k in v}
            for path, v in j["kvservice"].items()
            if not path.startswith("_")
        }
    rpc = j["rpc"]
    return {
        "e2e_p50_ms": rpc["transfer_e2e"]["p50_ms"],
        "e2e_p99_ms": rpc["transfer_e2e"]["p99_ms"],
        "expect_p50_ms": rpc["expect_delta"]["p50_ms"],
        "send_p50_ms": rpc["send_delta"]["p50_ms"],
        "sustained_per_s": {
            str(s["threads"]): s["transfers_per_s"] for s in j.get("sustained_by_senders", [])
        },
    }


def commit_of(tree: Path) -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    return r.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--bench", choices=("control", "transfer"), default="control")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--what", default="", help="what the two sides differ in (goes into the JSON)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench_control.py's arguments")
    args = ap.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.rounds):
            for side, tree in (("base", args.base), ("new", args.new)):
                tag = f"ab_{side}_r{n}"
                script = f"bench/bench_{args.bench}.py"
                cmd = [sys.executable, script, *bench_args, "--out", tmp, "--tag", tag]
                subprocess.run(cmd, cwd=tree.resolve(), check=True)
                (path,) = Path(tmp).glob(f"{args.bench}_*_{tag}.json")
                j = json.loads(path.read_text())
                runs.append({"side": side, "round": n, "commit": commit_of(tree), "argv": j["meta"]["argv"]}
                            | headline(j))  # fmt: skip
    summary: dict[str, Any] = {}
    for side in ("base", "new"):
        mine = [r for r in runs if r["side"] == side]
        if args.bench == "transfer":
            summary[side] = {
                path: {"p50_ms": [round(r[path]["p50_ms"], 3) for r in mine if path in r]}
                for path in mine[0]
                if isinstance(mine[0][path], dict) and "p50_ms" in mine[0][path]
            }
            continue
        summary[side] = {
            "runs": len(mine),
            "e2e_p50_ms": [round(r["e2e_p50_ms"], 3) for r in mine],
            "expect_p50_ms": [round(r["expect_p50_ms"], 3) for r in mine],
            "sustained_per_s": {
                k: [round(r["sustained_per_s"][k]) for r in mine] for k in mine[0]["sustained_per_s"]
            },
        }
    out = {
        "benchmark": "ab",
        "what": args.what,
        "host": f"{platform.node()}, {len(__import__('os').sched_getaffinity(0))} CPUs",
        "command": " ".join(["python bench/ab_trees.py", *sys.argv[1:]]),
        "unix_time": time.time(),
        "summary": summary,
        "runs": runs,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
