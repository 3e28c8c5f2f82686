"""The committed benchmark results: one file per suite and hardware kind, each goal row read from
runs of its suite, and a SUMMARY.md that is exactly what bench/summary.py makes of them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))
from suites import SUITES  # noqa: E402
from summary import summary_lines  # noqa: E402


def test_every_goal_reads_steps_of_its_suite_and_every_step_is_a_script() -> None:
    """A goal names only steps its suite runs; a step runs a script that exists in bench/."""
    for suite in SUITES.values():
        names = [s.name for s in suite.steps]
        assert len(names) == len(set(names)), suite.name
        for g in suite.goals:
            assert set(g.steps) | set(g.extra) <= set(names), (suite.name, g.goal)
        for s in suite.steps:
            assert (BENCH / s.argv[0]).is_file(), (suite.name, s.argv[0])


def test_results_are_one_file_per_suite_and_kind_with_a_plot() -> None:
    """bench/results holds <kind>/<suite>.json (+ .png), NOTES.md and SUMMARY.md, nothing else."""
    loose = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    assert loose == ["NOTES.md", "SUMMARY.md"], loose
    files = sorted(RESULTS.glob("*/*"))
    assert files, "no results"
    for p in files:
        assert p.suffix in (".json", ".png") and p.stem in SUITES, p
        if p.suffix == ".json":
            rep = json.loads(p.read_text())
            assert (rep["suite"], rep["kind"]) == (p.stem, p.parent.name), p
            goals = {g.goal for g in SUITES[rep["suite"]].goals}
            for row in rep["goals"]:
                assert row["goal"] in goals and set(row["steps"]) <= set(rep["runs"]), (p, row["goal"])


def test_summary_is_generated_and_short() -> None:
    """SUMMARY.md equals bench/summary.py's output over the committed results, in <= 100 lines."""
    text = (RESULTS / "SUMMARY.md").read_text()
    assert text == "\n".join(summary_lines(RESULTS)).rstrip() + "\n", "run: python bench/summary.py"
    assert len(text.splitlines()) <= 100
    assert "NOTES.md" not in text
