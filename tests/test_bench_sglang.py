"""bench_adapter_sglang_e2e's figures and the engines suite's SGLang goal, on made-up runs: a
mismatch or a failed request is reported, never hidden; the goal is met only when the tokens are
equal and kvservice adds no more than each baseline pair that ran; ``run.py --steps`` keeps the
other steps' rows. (The bench against real servers: tests/adapters/test_sglang_real_e2e.py.)"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("bench_adapter_sglang_e2e")


def _row(turn: int, single: float, pair: float, ids: list[int], got: list[int], failed: str = "") -> dict:
    return {
        "conversation": 0,
        "turn": turn,
        "single_s": single,
        "pair_s": pair,
        "prefill_half_s": pair / 2,
        "added_s": pair - single,
        "failed": failed,
        "equal_to_single": not failed and ids == got,
        "single_ids": ids,
        "pair_ids": got,
    }


def test_summary_lists_mismatches_and_failures_and_times_only_answered_requests(bench: Any) -> None:
    """A token mismatch is listed with where it starts; a failed request is counted with its reason
    and left out of the times; all_equal_to_single is then false."""
    rows = [
        _row(0, 0.100, 0.130, [5, 6, 7], [5, 6, 7]),
        _row(1, 0.200, 0.260, [5, 6, 7], [5, 9, 7]),
        _row(2, 0.100, 9.0, [1], [], failed="HTTP 500: boom"),
    ]
    s = bench.summary(rows)
    assert s["all_equal_to_single"] is False
    assert [(m["turn"], m["first_difference_at"]) for m in s["mismatches"]] == [(1, 1)]
    assert s["failures"] == [{"conversation": 0, "turn": 2, "why": "HTTP 500: boom"}]
    assert s["added"]["n"] == 2 and s["added"]["mean_ms"] == pytest.approx(45.0)
    assert s["added_first_turn"]["p50_ms"] == pytest.approx(30.0)
    assert s["after_prefill_half"]["mean_ms"] == pytest.approx((65 + 130) / 2)
    assert bench.summary(rows[:1])["all_equal_to_single"] is True


def _result(kv: float, mooncake: float | None, nixl_error: str = "", equal: bool = True) -> dict:
    def backend(added: float) -> dict:
        return {
            "all_equal_to_single": equal,
            "single": {"p50_ms": 150.0},
            "added": {"p50_ms": added, "mean_ms": added, "p99_ms": added},
        }

    r: dict[str, Any] = {
        "kvservice": backend(kv),
        "nixl": {"error": nixl_error} if nixl_error else backend(90),
    }
    if mooncake is not None:
        r["mooncake"] = backend(mooncake)
    return {"results": r}


def test_the_sglang_goal_needs_equal_tokens_and_no_more_than_each_baseline(monkeypatch: Any) -> None:
    """Met with equal tokens and the least added time; missed when a baseline adds less or the
    tokens differ; a baseline that did not run shows its reason and is not compared."""
    monkeypatch.syspath_prepend(str(BENCH))
    from suites import sglang_added

    def met(j: dict) -> bool | None:
        row = sglang_added(j)
        assert row is not None
        return row.met

    assert met(_result(40, 50)) is True
    assert met(_result(60, 50)) is False
    assert met(_result(40, 50, equal=False)) is False
    row = sglang_added(_result(40, None, nixl_error="not run: boom"))
    assert (
        row is not None
        and row.met is True
        and "nixl: not run: boom" in row.baseline
        and "mooncake: not run" in row.baseline
    )
    assert sglang_added({"results": {"kvservice": {"error": "x"}}}) is None


def test_run_steps_keeps_the_other_steps_rows_with_their_dates(monkeypatch: Any, tmp_path: Path) -> None:
    """run.py --steps: the steps run now replace their runs and rows (today's date); the others stay
    as the previous result has them (their date and load), in the suite's goal order."""
    monkeypatch.syspath_prepend(str(BENCH))
    run = importlib.import_module("run")
    from suites import SUITES

    suite = SUITES["engines"]
    vllm_goal, sglang_goal = suite.goals[0].goal, suite.goals[1].goal
    before = {
        "date": "2026-01-01",
        "load_at_start": 0.2,
        "goals": [{"goal": vllm_goal, "steps": ["vllm_pair"], "figure": "old"}],
        "runs": {"vllm_pair": {"old": True}, "sglang_pair": {"stale": True}},
    }
    fresh = [{"goal": sglang_goal, "steps": ["sglang_pair"], "figure": "new"}]
    runs, rows = run._merge(before, suite, {"sglang_pair": {"new": True}}, fresh, "2026-02-02")
    assert runs == {"vllm_pair": {"old": True}, "sglang_pair": {"new": True}}
    assert [(r["goal"], r["date"]) for r in rows] == [(vllm_goal, "2026-01-01"), (sglang_goal, "2026-02-02")]
    assert rows[0]["load_at_start"] == 0.2 and "load_at_start" not in rows[1]  # the new run's: the report's
