"""Modules that moved keep their old name for a release: importing it warns (DeprecationWarning
naming the new module) and gives the very objects of the new one; ``python -m kvservice.lane.native``
still builds the native lane."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from kvservice.transfer import landing, lane
from kvservice.transfer.lane import native


def _fresh(name: str) -> tuple[object, list[warnings.WarningMessage]]:
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in seen if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize(
    "old, new",
    [("kvservice.lane", lane), ("kvservice.landing", landing), ("kvservice.lane.native", native)],
)
def test_an_old_name_warns_and_gives_the_new_objects(old: str, new: object) -> None:
    module, seen = _fresh(old)
    assert any(new.__name__ in str(w.message) for w in seen), [str(w.message) for w in seen]
    for name in module.__all__:  # type: ignore[attr-defined]
        assert getattr(module, name) is getattr(new, name), name


def test_the_new_names_import_without_a_warning() -> None:
    run = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", "import kvservice.transfer.lane.native"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_old_build_command_still_builds_the_lane() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvservice.lane.native"], capture_output=True, text=True, timeout=600
    )
    assert "deprecated: use kvservice.transfer.lane.native" in run.stderr
    new = subprocess.run(
        [sys.executable, "-m", "kvservice.transfer.lane.native"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == new.returncode, (run.stderr[-2000:], new.stderr[-2000:])
    assert run.stdout == new.stdout  # the same built library (or the same reason it is unavailable)
