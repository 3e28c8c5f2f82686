"""``LatestQueue``: an asyncio queue that keeps only the newest value per key.

For streams whose consumer may be slower than the changes it is told of (transfer watchers,
session notices): each key is delivered once with its newest value, in order of its first
change since it was last taken. ``put`` runs on the queue's event loop (from other threads:
``loop.call_soon_threadsafe(queue.put, key, value)``).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["LatestQueue"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LatestQueue(Generic[K, V]):
    def __init__(self) -> None:
        self._items: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._ready = asyncio.Event()

    def put(self, key: K, value: V) -> None:
        self._items[key] = value  # an update keeps its place; the value is the newest
        self._ready.set()

    async def get(self) -> tuple[K, V]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popitem(last=False)
