"""Helpers shared by the index tests (a test clock, chained hashes of synthetic prompts)."""

from __future__ import annotations

import numpy as np
from kvservice_client.hashing import page_hashes


class Clock:
    """A settable millisecond clock."""

    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms


def hashes_of(n_pages: int, start: int = 0, page_size: int = 4) -> np.ndarray:
    """Chained hashes of a prompt whose tokens are start, start+1, ..."""
    return page_hashes(np.arange(start, start + n_pages * page_size, dtype=np.uint64), page_size)
