"""The opt-in scheduler-hook timer: wraps only when asked, one step per build_connector_meta."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvservice_vllm import sched_timer


class _Hooks:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def _hook(name: str):  # type: ignore[no-untyped-def]  # noqa: N805
        def hook(self, *args):  # type: ignore[no-untyped-def]
            self.calls.append(name)
            return name

        return hook

    get_num_new_matched_tokens = _hook("get_num_new_matched_tokens")
    update_state_after_alloc = _hook("update_state_after_alloc")
    build_connector_meta = _hook("build_connector_meta")
    update_connector_output = _hook("update_connector_output")
    request_finished = _hook("request_finished")
    has_pending_push_work = _hook("has_pending_push_work")


def test_unset_wraps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sched_timer.ENV, raising=False)
    obj = _Hooks()
    assert sched_timer.maybe_time(obj) is None
    assert "build_connector_meta" not in vars(obj)  # the class's own methods, unwrapped


def test_steps_close_at_build_connector_meta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sched.json"
    monkeypatch.setenv(sched_timer.ENV, str(path))
    obj = _Hooks()
    timer = sched_timer.maybe_time(obj)
    assert timer is not None
    assert obj.get_num_new_matched_tokens(1, 2) == "get_num_new_matched_tokens"  # results pass through
    obj.build_connector_meta(None)
    obj.update_connector_output(None)
    obj.request_finished(1, 2)
    obj.build_connector_meta(None)
    timer.write()
    data = json.loads(path.read_text())
    assert data["steps"] == 2 and len(data["per_step_us"]) == 2
    assert data["hooks"]["build_connector_meta"]["calls"] == 2
    assert data["hooks"]["request_finished"]["calls"] == 1
    assert data["hooks"]["update_state_after_alloc"]["calls"] == 0
    assert obj.calls[-1] == "build_connector_meta"
