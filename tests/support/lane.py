"""The native lane in tests: a service's running lane, and two engines on one service with their
shm pools registered (random bytes) and page-level views for byte checks."""

from __future__ import annotations

from typing import Any

import numpy as np
from kvservice_client import Client, Layout, ShmKVPool

from tests.support.poll import eventually

__all__ = ["LAYOUT", "Engines", "lane_of"]

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=32, total_kv_heads=2, head_dim=8, dtype="float16")


def lane_of(server: Any) -> Any:
    """The server's running lane (waits for its background start; the build is cached)."""
    task = eventually(lambda: server.app.lane, 5, "lane task")
    eventually(task.done, 120, "lane started")
    running = task.result()
    assert running is not None, "the native lane did not start (see the service log)"
    return running


class Engines:
    """A prefill and a decode engine on one service, each with a random-filled shm pool."""

    def __init__(self, server: Any, layout: Layout = LAYOUT, **client_kw: Any) -> None:
        self.server = server
        self.layout = layout
        self.lane = lane_of(server)
        self.pa, self.pb = ShmKVPool.create(layout), ShmKVPool.create(layout)
        rng = np.random.default_rng(3)
        for pool in (self.pa, self.pb):
            for r in self.regions(pool):
                r[:] = rng.integers(0, 256, r.shape, dtype=np.uint8)
        self.ka = Client(server.address, client_name="prefill", **client_kw)
        self.kb = Client(server.address, client_name="decode", **client_kw)
        self.a = self.ka.register_buffers(layout, self.pa.k_regions, self.pa.v_regions).buffer_set_id
        self.b = self.kb.register_buffers(layout, self.pb.k_regions, self.pb.v_regions).buffer_set_id
        self.peer = server.app.peer_address

    def regions(self, pool: ShmKVPool) -> list[np.ndarray]:
        """Every KV region as ``[num_pages, page_bytes]`` uint8 (K layers, then V layers)."""
        return [pool.k(i) for i in range(self.layout.num_layers)] + [
            pool.v(i) for i in range(self.layout.num_v_regions)
        ]

    def pages(self, pool: ShmKVPool, pages: list[int]) -> list[bytes]:
        return [r[p].tobytes() for r in self.regions(pool) for p in pages]

    def snapshot(self) -> list[np.ndarray]:
        return [r.copy() for r in self.regions(self.pb)]

    def changed_pages(self, before: list[np.ndarray]) -> set[int]:
        got: set[int] = set()
        for old, now in zip(before, self.regions(self.pb), strict=True):
            got |= set(np.flatnonzero((old != now).any(axis=1)).tolist())
        return got

    def close(self) -> None:
        self.ka.close()
        self.kb.close()
        self.pa.close()
        self.pb.close()
