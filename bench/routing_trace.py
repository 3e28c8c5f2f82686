"""Multi-turn agentic traces for the routing benchmark (seed 002's workloads, synthetic).

A trace is sessions of turns. Turn k of a session sends the whole conversation so far: the
session's shared system prefix (sessions of one group share it: prefix overlap across
sessions), then every earlier turn's appended user tokens and model output, then this turn's
append. Token ids are drawn per session, so equal prefixes hash equal and nothing else does.

Shapes (defaults, token counts scaled to a CPU run; the notes' traces are larger):

  micro          316 requests in 58 sessions (the notes' micro workload), large first turns,
                 medium appends
  small-append   81 requests in 28 sessions, 53 of them later turns, with small appends (the
                 notes' filtered trace: where direct-to-decode pays)
  long-prompt    96 requests in 24 sessions with long prompts (4-8K shared system prefix, 2-6K
                 first turns): with small decode pools, decode pre-allocation is the bottleneck
                 (seed 002's #prealloc-req; where admission+landing is measured)

``generate(shape, seed)`` is deterministic for a seed (tests check it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["SHAPES", "Shape", "Trace", "Turn", "generate", "profile"]


@dataclasses.dataclass(frozen=True)
class Shape:
    sessions: int
    requests: int
    groups: int  # sessions share the system prefix of their group
    system_tokens: tuple[int, int]  # shared prefix length range
    first_append: tuple[int, int]  # first turn's own tokens
    append: tuple[int, int]  # later turns' appended tokens
    output: tuple[int, int]  # output tokens per turn
    gap_s: float  # mean think time between a turn's answer and the next turn (exponential)
    span_s: float  # sessions start uniformly over this span


SHAPES: dict[str, Shape] = {
    "micro": Shape(58, 316, 6, (1024, 3072), (512, 2048), (256, 1536), (32, 256), 1.5, 20.0),
    "small-append": Shape(28, 81, 4, (1024, 3072), (1024, 4096), (32, 256), (32, 512), 2.0, 12.0),
    "long-prompt": Shape(24, 96, 4, (4096, 8192), (2048, 6144), (256, 1024), (32, 256), 1.5, 10.0),
}


@dataclasses.dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    start_s: float  # session start (turn 0) or think time after the previous answer (turn > 0)
    prompt: np.ndarray  # uint32 token ids: the whole conversation up to this turn's append
    output: np.ndarray  # the model's answer (its KV is produced on the decode engine)

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt.size)


@dataclasses.dataclass(frozen=True)
class Trace:
    shape: str
    seed: int
    sessions: list[list[Turn]]

    @property
    def requests(self) -> int:
        return sum(len(s) for s in self.sessions)


def _turn_counts(rng: np.random.Generator, sessions: int, requests: int) -> np.ndarray:
    """Turns per session, each >= 1, summing to ``requests`` (skewed: a few long sessions)."""
    w = rng.pareto(1.5, sessions) + 1.0
    extra = requests - sessions
    counts = np.ones(sessions, dtype=np.int64) + np.floor(w / w.sum() * extra).astype(np.int64)
    short = requests - int(counts.sum())
    counts[np.argsort(-w)[:short]] += 1
    return counts


def generate(shape: str = "micro", seed: int = 0, scale: float = 1.0) -> Trace:
    """The trace of ``shape`` for ``seed``; ``scale`` shrinks token counts (CI)."""
    sh = SHAPES[shape]
    rng = np.random.default_rng(seed)

    def draw(r: tuple[int, int]) -> int:
        return max(1, int(rng.integers(r[0], r[1] + 1) * scale))

    systems = [
        rng.integers(1, 2**31, draw(sh.system_tokens), dtype=np.uint32) for _ in range(sh.groups)
    ]  # fmt: skip
    counts = _turn_counts(rng, sh.sessions, sh.requests)
    starts = np.sort(rng.uniform(0, sh.span_s, sh.sessions))
    out = []
    for s in range(sh.sessions):
        history = systems[s % sh.groups]
        turns = []
        for k in range(int(counts[s])):
            append = rng.integers(1, 2**31, draw(sh.first_append if k == 0 else sh.append), dtype=np.uint32)
            prompt = np.concatenate([history, append])
            output = rng.integers(1, 2**31, draw(sh.output), dtype=np.uint32)
            start = float(starts[s]) if k == 0 else float(rng.exponential(sh.gap_s))
            turns.append(Turn(s, k, start, prompt, output))
            history = np.concatenate([prompt, output])
        out.append(turns)
    return Trace(shape, seed, out)


def profile(trace: Trace, page_size: int) -> dict[str, Any]:
    """What the notes' ``profile`` reports: sessions, later turns, appends, overlap ratio."""
    later = [t for s in trace.sessions for t in s if t.turn > 0]
    prompts = [t.prompt_tokens for s in trace.sessions for t in s]
    appends = [
        t.prompt_tokens - (s[t.turn - 1].prompt_tokens + s[t.turn - 1].output.size)
        for s in trace.sessions
        for t in s[1:]
    ]
    reused = sum(t.prompt_tokens - a for t, a in zip(later, appends, strict=True))
    return {
        "shape": trace.shape,
        "seed": trace.seed,
        "requests": trace.requests,
        "sessions": len(trace.sessions),
        "later_turns": len(later),
        "prompt_tokens": {"mean": float(np.mean(prompts)), "max": int(np.max(prompts))},
        "append_tokens_later": {
            "mean": float(np.mean(appends)) if appends else 0.0,
            "p90": float(np.percentile(appends, 90)) if appends else 0.0,
        },
        "overlap_ratio_later": reused / max(sum(t.prompt_tokens for t in later), 1),
        "page_size": page_size,
    }
