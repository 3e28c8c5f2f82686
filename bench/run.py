"""Run a benchmark suite: ``python bench/run.py SUITE [--small] [--steps A,B] [--results DIR]``.

Each step of the suite (bench/suites.py) runs an existing benchmark script with its same-run
baselines; each goal is read from those runs. The result is the latest file of this suite on
this hardware kind, ``<results>/<kind>/<suite>.json`` (goal rows, the command, the date, the
commit, and every step's own JSON), one plot beside it (``<suite>.png``: kvservice beside its
baseline per goal), and ``<results>/SUMMARY.md`` regenerated from every such file (summary.py).
A kind is ``cpu-<N>core`` without a GPU, else the GPU's model (``h200``). Older results stay in git.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from suites import SUITES, Suite  # noqa: E402
from summary import write_summary  # noqa: E402

RESULTS = HERE / "results"


def hardware() -> tuple[str, str]:
    """(kind, description) of this machine: ``cpu-2core`` / ``h200`` and its words."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.split("\n")
        names = [n.strip() for n in out if n.strip()]
    except (OSError, subprocess.TimeoutExpired):
        names = []
    if names:
        model = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", names[0])
        kind = model.group(1).lower() if model else re.sub(r"\W+", "-", names[0].lower())
        return kind, f"{len(names)}x {names[0]}"
    cores = os.cpu_count() or 1
    return f"cpu-{cores}core", f"{cores}-core machine, CPU"


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip() or "?"


def _mps(on: bool) -> None:
    if on:
        os.environ |= {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps", "CUDA_MPS_LOG_DIRECTORY": "/tmp/mpslog"}
        os.makedirs("/tmp/mps", exist_ok=True)
        os.makedirs("/tmp/mpslog", exist_ok=True)
        subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
    else:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, check=False)
        for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            os.environ.pop(k, None)


def run_steps(suite: Suite, small: bool, work: Path) -> dict[str, dict[str, Any]]:
    """Each step's JSON, by step name (a step that failed or wrote none is left out and said)."""
    # (what the caller's PYTHONPATH holds stays behind ours: a GPU host's wheels in /tmp/site)
    paths = [str(ROOT), str(ROOT / "clients/python"), *filter(None, [os.environ.get("PYTHONPATH", "")])]
    pythonpath = os.pathsep.join(paths)
    runs: dict[str, dict[str, Any]] = {}
    for step in suite.steps:
        out = work / step.name
        python = str(ROOT / step.python) if step.python else sys.executable
        argv = [python, str(HERE / step.argv[0]), *step.argv[1:], *(["--small"] if small else [])]
        argv += ["--out", str(out / "run.json" if step.out_file else out)]
        out.mkdir(parents=True, exist_ok=True)
        print(f"== {step.name}: {' '.join(step.argv)}", flush=True)
        if step.mps:
            _mps(True)
        try:
            # NOTE: the environment as it is now: _mps just set the pipe directory the step's
            # processes must find the MPS daemon by
            env = {**os.environ, "PYTHONPATH": pythonpath, **dict(step.env)}
            done = subprocess.run(argv, cwd=ROOT, env=env, timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            print(f"   {step.name}: over {step.timeout_s} s, left out", flush=True)
            continue
        finally:
            if step.mps:
                _mps(False)
        files = sorted(out.glob("*.json"))
        if done.returncode != 0 or not files:
            print(f"   {step.name}: exit {done.returncode}, {len(files)} JSON file(s): left out", flush=True)
            continue
        runs[step.name] = json.loads(files[-1].read_text())
    return runs


def goal_rows(suite: Suite, runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per goal whose steps all ran."""
    rows = []
    for g in suite.goals:
        if not all(s in runs for s in g.steps):
            continue
        row = g.read(*(runs[s] for s in g.steps), *(runs.get(s) for s in g.extra))
        if row is not None:
            used = [*g.steps, *(s for s in g.extra if s in runs)]
            rows.append({"area": g.area, "goal": g.goal, "steps": used, **row._asdict()})
    return rows


def _merge(
    before: dict[str, Any],
    suite: Suite,
    runs: dict[str, dict[str, Any]],
    rows: list[dict[str, Any]],
    date: str,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """A run of some steps over the suite's previous result: the steps that ran now replace their
    runs and the goal rows that read them (dated ``date``); the rest stay as they were, each row
    keeping its date and the load its run started under (in the suite's goal order)."""
    fresh = {r["goal"]: {**r, "date": date} for r in rows}
    kept = {
        g["goal"]: {
            **g,
            "date": g.get("date", before.get("date")),
            "load_at_start": g.get("load_at_start", before.get("load_at_start")),
        }
        for g in before.get("goals", [])
        if g["goal"] not in fresh and not set(g["steps"]) & set(runs)
    }
    order = [g.goal for g in suite.goals]
    merged = {**kept, **fresh}
    return {**{k: v for k, v in before.get("runs", {}).items() if k not in runs}, **runs}, [
        merged[g] for g in order if g in merged
    ]


def plot(path: Path, title: str, rows: list[dict[str, Any]]) -> None:
    """kvservice beside its same-run baseline (ms), one pair of bars per goal that has both."""
    pairs = [r for r in rows if r.get("value_ms") and r.get("baseline_ms")]
    if not pairs:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.55 * len(pairs) + 1.4))
    y = range(len(pairs))
    ax.barh([i + 0.2 for i in y], [r["value_ms"] for r in pairs], 0.4, label="kvservice p50")
    ax.barh([i - 0.2 for i in y], [r["baseline_ms"] for r in pairs], 0.4, label="same-run baseline p50")
    ax.set_yticks(list(y), [r["goal"][:60] for r in pairs], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("ms (log)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("--small", action="store_true", help="CI sizes (the figures then mean nothing)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where <kind>/<suite>.json goes")
    ap.add_argument(
        "--steps",
        default="",
        help="only these steps (comma-separated): the other steps' runs and goal rows stay as the "
        "current <kind>/<suite>.json has them, each row with its own date",
    )
    ns = ap.parse_args(argv)
    suite = SUITES[ns.suite]
    chosen = [n for n in ns.steps.split(",") if n]
    unknown = set(chosen) - {s.name for s in suite.steps}
    if unknown:
        ap.error(f"--steps: {sorted(unknown)} not in suite {suite.name} ({[s.name for s in suite.steps]})")
    kind, words = hardware()
    out = ns.results / kind
    started, load = time.time(), os.getloadavg()[0]  # other work on the machine skews its figures
    todo = suite._replace(steps=tuple(s for s in suite.steps if s.name in chosen)) if chosen else suite
    with tempfile.TemporaryDirectory(prefix=f"bench-{suite.name}-") as work:
        runs = run_steps(todo, ns.small, Path(work))
    rows = goal_rows(suite, runs)
    date = time.strftime("%Y-%m-%d", time.gmtime(started))
    if chosen and (out / f"{suite.name}.json").exists():
        runs, rows = _merge(json.loads((out / f"{suite.name}.json").read_text()), suite, runs, rows, date)
    report = {
        "suite": suite.name,
        "kind": kind,
        "hardware": words,
        "date": date,
        "commit": _commit(),
        "command": f"python bench/run.py {suite.name}" + (" --small" if ns.small else ""),
        "wall_s": round(time.time() - started, 1),
        "load_at_start": round(load, 2),
        "goals": rows,
        "runs": runs,
    }
    if chosen:
        report["steps_run"] = [s.name for s in todo.steps]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{suite.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(out / f"{suite.name}.png", f"{suite.name} on {words} ({report['date']}, {report['commit']})", rows)
    write_summary(ns.results)
    for r in rows:
        status = "" if r["met"] is None else ("met" if r["met"] else "MISSED")
        print(f"{r['area']}: {r['goal']}: {r['figure']} | {r['baseline']} | {status}")
    print(f"wrote {out / f'{suite.name}.json'} ({len(rows)}/{len(suite.goals)} goals, {report['wall_s']} s)")
    return 0 if len(runs) == len(suite.steps) else 1  # a goal a --small run does not measure is left out


if __name__ == "__main__":
    sys.exit(main())
