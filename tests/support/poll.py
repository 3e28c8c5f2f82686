"""Poll until a condition holds: the one wait-for helper of the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["eventually"]


def eventually(
    pred: Callable[[], Any],
    timeout: float = 30.0,
    what: str | Callable[[], str] = "",
    interval: float = 0.01,
) -> Any:
    """``pred()``'s first truthy value, polled every ``interval`` seconds; AssertionError naming
    ``what`` (a callable: what it says once the time is up, e.g. the last state seen) if none came
    within ``timeout`` seconds. An exception from ``pred`` ends the wait with it."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            said = what() if callable(what) else what
            raise AssertionError(f"not true within {timeout}s: {said or pred}")
        time.sleep(interval)
