"""Poll until a condition holds: the one wait-for helper of the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["eventually"]


def eventually(pred: Callable[[], Any], timeout: float = 30.0, what: str = "", interval: float = 0.01) -> Any:
    """``pred()``'s first truthy value, polled every ``interval`` seconds; AssertionError naming
    ``what`` if none came within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"not true within {timeout}s: {what or pred}")
        time.sleep(interval)
