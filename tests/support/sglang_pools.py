"""SGLang-shaped KV pools in POSIX shared memory (per-layer K and V buffers, two metadata buffers
of per-request rows) and the kvservice_sglang manager over them, for the adapter tests."""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Any

import numpy as np

__all__ = ["AUX", "DIM", "HEADS", "ITEM", "LAYERS", "PAGE", "PAGES", "Pools", "manager"]

LAYERS, PAGE, HEADS, DIM, PAGES = 2, 4, 2, 16, 64
ITEM = PAGE * HEADS * DIM * 2  # float16 bytes per page per buffer
AUX = [(8, 16), (64, 16)]  # metadata buffers: (row bytes, rows), e.g. output ids, hidden states


class Pools:
    """SGLang-shaped pools in shm: K_0..K_{L-1}, V_0..V_{L-1}, then the metadata buffers."""

    def __init__(self, seed: int) -> None:
        kv = 2 * LAYERS * PAGES * ITEM
        self.shm = shared_memory.SharedMemory(create=True, size=kv + sum(r * n for r, n in AUX))
        raw = np.frombuffer(self.shm.buf, dtype=np.uint8)
        raw[:] = np.random.default_rng(seed).integers(0, 255, raw.size, dtype=np.uint8)
        self.bufs = [
            raw[i * PAGES * ITEM : (i + 1) * PAGES * ITEM].reshape(PAGES, ITEM) for i in range(2 * LAYERS)
        ]
        self.aux, off = [], kv
        for row, n in AUX:
            self.aux.append(raw[off : off + row * n].reshape(n, row))
            off += row * n

    def kv_args(self, conn: Any) -> Any:
        a = conn.KVArgs()
        a.engine_rank, a.gpu_id, a.page_size = 0, 0, PAGE
        a.kv_data_ptrs = [b.ctypes.data for b in self.bufs]
        a.kv_data_lens = [PAGES * ITEM] * len(self.bufs)
        a.kv_item_lens = [ITEM] * len(self.bufs)
        a.kv_cache_dtype_str = "torch.float16"
        a.kv_head_num = a.total_kv_head_num = HEADS
        a.aux_data_ptrs = [x.ctypes.data for x in self.aux]
        a.aux_data_lens = [x.nbytes for x in self.aux]
        a.aux_item_lens = [x.shape[1] for x in self.aux]
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        return a

    def snapshot(self) -> list[np.ndarray]:
        return [b.copy() for b in self.bufs] + [x.copy() for x in self.aux]

    def close(self) -> None:
        del self.bufs, self.aux
        self.shm.close()
        self.shm.unlink()


def manager(
    conn: Any, monkeypatch: Any, server: Any, mode: str, pools: Pools, server_args: Any = None, **env: str
) -> Any:
    """kvservice_sglang's KVServiceManager (``mode``: prefill or decode) on ``server`` over ``pools``."""
    monkeypatch.setenv("SGLANG_KVSERVICE_ADDRESS", server.address)
    monkeypatch.setenv("SGLANG_KVSERVICE_PEER_ADDRESS", server.app.peer_address)
    monkeypatch.delenv("SGLANG_KVSERVICE_LANDING_TTL_MS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return conn.KVServiceManager(pools.kv_args(conn), mode, server_args, False)
