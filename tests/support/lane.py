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
    """A prefill and a decode engine on one service, each with a random-filled shm pool (and aux
    regions ``aux``: name -> (row_bytes, rows), random-filled too); the decode's pool of
    ``dst_layout`` when given (a conversion), else of ``layout`` too."""

    def __init__(
        self,
        server: Any,
        layout: Layout = LAYOUT,
        aux: dict[str, tuple[int, int]] | None = None,
        dst_layout: Layout | None = None,
        **client_kw: Any,
    ) -> None:
        self.server = server
        self.layout = layout
        self.dst_layout = dst_layout or layout
        self.lane = lane_of(server)
        self.aux_names = list(aux or {})
        self.pa, self.pb = ShmKVPool.create(layout, aux), ShmKVPool.create(self.dst_layout, aux)
        rng = np.random.default_rng(3)
        for pool in (self.pa, self.pb):
            for r in self.regions(pool) + [pool.aux(n) for n in self.aux_names]:
                r[:] = rng.integers(0, 256, r.shape, dtype=np.uint8)
        self.ka = Client(server.address, client_name="prefill", **client_kw)
        self.kb = Client(server.address, client_name="decode", **client_kw)
        self.a = self.ka.register_buffers(
            layout, self.pa.k_regions, self.pa.v_regions, aux=self.pa.aux_specs
        ).buffer_set_id
        self.b = self.kb.register_buffers(
            self.dst_layout, self.pb.k_regions, self.pb.v_regions, aux=self.pb.aux_specs
        ).buffer_set_id
        self.peer = server.app.peer_address

    @staticmethod
    def regions(pool: ShmKVPool) -> list[np.ndarray]:
        """Every KV region as ``[num_pages, page_bytes]`` uint8 (K layers, then V layers)."""
        lay = pool.layout
        return [pool.k(i) for i in range(lay.num_layers)] + [pool.v(i) for i in range(lay.num_v_regions)]

    def pages(self, pool: ShmKVPool, pages: list[int]) -> list[bytes]:
        return [r[p].tobytes() for r in self.regions(pool) for p in pages]

    def rows(self, pool: ShmKVPool, name: str, rows: list[int]) -> bytes:
        return pool.aux(name)[rows].tobytes()

    def snapshot(self) -> list[np.ndarray]:
        return [r.copy() for r in self.regions(self.pb)]

    def aux_snapshot(self) -> dict[str, np.ndarray]:
        return {n: self.pb.aux(n).copy() for n in self.aux_names}

    def changed_rows(self, before: dict[str, np.ndarray]) -> dict[str, set[int]]:
        return {
            n: set(np.flatnonzero((old != self.pb.aux(n)).any(axis=1)).tolist()) for n, old in before.items()
        }

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
