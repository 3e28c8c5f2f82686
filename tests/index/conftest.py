"""Fixtures for the prefix index tests: an index with two buffer sets on a test clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvservice.index import PrefixIndex
from tests.support.index import Clock


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def index(clock: Clock) -> Iterator[PrefixIndex]:
    ix = PrefixIndex(clock_ms=clock)
    ix.add_buffer_set("a", engine_id="e0", page_size=4, num_pages=64, tp_rank=0, dp_rank=0)
    ix.add_buffer_set("b", engine_id="e1", page_size=4, num_pages=64, tp_rank=0, dp_rank=1)
    yield ix
    ix.check_integrity()
