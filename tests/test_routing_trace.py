"""bench/routing_trace.py: the routing benchmark's traces are deterministic and have the shapes
the seed-002 notes describe."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from routing_trace import generate, profile  # noqa: E402


@pytest.mark.parametrize("shape", ["micro", "small-append", "long-prompt"])
def test_same_seed_same_trace_other_seed_other_trace(shape: str) -> None:
    a, b, c = generate(shape, 7), generate(shape, 7), generate(shape, 8)

    def flat(t):  # noqa: ANN001, ANN202
        return [
            (x.session, x.turn, x.start_s, x.prompt.tobytes(), x.output.tobytes())
            for s in t.sessions
            for x in s
        ]

    assert flat(a) == flat(b)
    assert flat(a) != flat(c)


def test_shapes_match_the_notes() -> None:
    micro = profile(generate("micro", 0), 16)
    assert (micro["requests"], micro["sessions"]) == (316, 58)
    small = profile(generate("small-append", 0), 16)
    assert (small["requests"], small["sessions"], small["later_turns"]) == (81, 28, 53)
    assert small["append_tokens_later"]["mean"] < micro["append_tokens_later"]["mean"]
    long = profile(generate("long-prompt", 0), 16)  # decode pre-allocation is the bottleneck
    assert (long["requests"], long["sessions"]) == (96, 24)
    assert long["prompt_tokens"]["mean"] > micro["prompt_tokens"]["mean"] > small["prompt_tokens"]["mean"]


def test_each_turn_extends_the_conversation() -> None:
    for session in generate("micro", 3).sessions:
        for prev, cur in zip(session, session[1:], strict=False):
            history = np.concatenate([prev.prompt, prev.output])
            assert np.array_equal(cur.prompt[: history.size], history) and cur.prompt.size > history.size
