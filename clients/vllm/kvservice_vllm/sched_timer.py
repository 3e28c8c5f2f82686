"""Opt-in timing of the connector's scheduler-side hooks, per engine step (for the benchmarks).

``KVSERVICE_VLLM_SCHED_TIMES=<path>`` in the engine's environment wraps the scheduler-side hooks of
one connector instance with ``perf_counter`` accumulation and writes what it measured to
``<path>`` (JSON, rewritten at most every 2 s and at shutdown). Unset, nothing is wrapped: the
hooks run as written, at no cost.

With it set, ``trace(event, transfer_id)`` also appends ``{"t": monotonic, "event", "tid", ...}``
lines to ``<path>.trace.jsonl`` (job made by the scheduler, submitted, done, picked up by the
engine step, reported finished): CLOCK_MONOTONIC is one clock for every process of the host, so a
benchmark lines them up with its own request times. Unset, ``trace`` returns at once.

A step's time is every hook's time from one ``build_connector_meta`` to the next::

    step k:  update_connector_output, request_finished, has_pending_push_work   (after step k-1 ran)
             get_num_new_matched_tokens, update_state_after_alloc            (scheduling step k)
             build_connector_meta                                            ─▶ closes step k
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import time
from array import array
from collections.abc import Callable
from typing import Any

__all__ = ["ENV", "SCHEDULER_HOOKS", "SchedulerTimer", "flush_trace", "maybe_time", "trace", "tracing"]

ENV = "KVSERVICE_VLLM_SCHED_TIMES"
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "has_pending_push_work",
)
_MAX_STEPS = 200_000
_WRITE_EVERY_S = 2.0
_TRACE = os.environ.get(ENV, "")
_TRACE_PATH = f"{_TRACE}.trace.jsonl" if _TRACE else ""


_lines: list[str] = []  # trace lines not yet written (appended by any thread: list.append is atomic)


def tracing() -> bool:
    return bool(_TRACE_PATH)


def trace(event: str, tid: str, **info: Any) -> None:
    """One timeline line, kept in memory (only with ``KVSERVICE_VLLM_SCHED_TIMES`` set; else
    nothing): file writes would land inside the very hooks being timed."""
    if _TRACE_PATH:
        line = {"t": time.monotonic(), "pid": os.getpid(), "event": event, "tid": tid, **info}
        _lines.append(json.dumps(line))


def flush_trace() -> None:
    """Append the kept lines to ``<path>.trace.jsonl`` (at exit, and when the timer writes)."""
    if not _lines:
        return
    n = len(_lines)
    with open(_TRACE_PATH, "a") as f:
        f.write("\n".join(_lines[:n]) + "\n")
    del _lines[:n]


if _TRACE_PATH:
    atexit.register(flush_trace)


class SchedulerTimer:
    def __init__(self, path: str) -> None:
        self.path = path
        self.steps = array("d")  # seconds of hook time per closed step
        self.calls: dict[str, int] = dict.fromkeys(SCHEDULER_HOOKS, 0)
        self.total: dict[str, float] = dict.fromkeys(SCHEDULER_HOOKS, 0.0)
        self._open = 0.0  # hook time of the step not yet closed
        self._written = time.monotonic()

    def wrap(self, obj: Any) -> None:
        """Replace ``obj``'s scheduler hooks (on the instance only) with timed ones."""
        for name in SCHEDULER_HOOKS:
            setattr(obj, name, self._timed(name, getattr(obj, name)))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        closes = name == "build_connector_meta"

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.calls[name] += 1
                self.total[name] += dt
                self._open += dt
                if closes:
                    if len(self.steps) < _MAX_STEPS:
                        self.steps.append(self._open)
                    self._open = 0.0
                    if time.monotonic() - self._written > _WRITE_EVERY_S:
                        self.write()

        return timed

    def write(self) -> None:
        self._written = time.monotonic()
        data = {
            "steps": len(self.steps),
            "per_step_us": [round(s * 1e6, 2) for s in self.steps],
            "hooks": {
                n: {"calls": self.calls[n], "total_us": round(self.total[n] * 1e6, 1)} for n in self.calls
            },
        }
        flush_trace()
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)


def maybe_time(obj: Any) -> SchedulerTimer | None:
    """Wrap ``obj``'s scheduler hooks when ``KVSERVICE_VLLM_SCHED_TIMES`` is set; else None."""
    path = os.environ.get(ENV, "")
    if not path:
        return None
    timer = SchedulerTimer(path)
    timer.wrap(obj)
    return timer
