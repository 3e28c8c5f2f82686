"""GPU: engine memory registered through CUDA IPC from another process (needs a CUDA GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.support.gpu import LAYOUT, Engine

pytestmark = pytest.mark.gpu


def test_service_writes_named_pages_of_an_engine_pool(server) -> None:
    """The service imports another process's tensors (one at a non-zero offset in a larger block),
    writes a pattern into named pages, and the engine sees exactly those pages changed."""
    eng = Engine()
    try:
        r = eng(op="register", address=server.address, layout=LAYOUT)
        assert r["k_offsets"][0] == 4096 and r["k_offsets"][1] > 4096
        bs = server.node.buffers.get(r["buffer_set_id"])
        assert bs.memory == "cuda_ipc"
        pb = bs.layout.page_bytes_k
        pages = [0, 5, 63]
        for layer in range(3):
            bs.k[layer].pages(pb)[pages] = 0xA5
        torch.cuda.synchronize()
        for layer in range(3):
            got = eng(op="check_fill", layer=layer, pages=pages, value=0xA5)
            assert got["named_ok"] and got["others_zero"], got
    finally:
        eng.close()
