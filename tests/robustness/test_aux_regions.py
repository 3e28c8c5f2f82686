"""Aux rows in GPU memory are refused at RegisterBuffers, at once, naming the aux region and
why (the transport moves aux rows from the region itself and cannot register CUDA IPC memory),
and nothing stays registered; before, the call failed deep in UCX naming no field."""

from __future__ import annotations

from typing import Any

import pytest
from kvservice_client import AuxSpec, Client, Region, ShmKVPool
from kvservice_client._errors import InvalidArgument

from tests.support.nodes import LAYOUT


def test_aux_rows_in_vram_are_refused_naming_the_field(server: Any) -> None:
    pool = ShmKVPool.create(LAYOUT)
    fake_gpu = Region(size_bytes=256 * 64, cuda_handle=b"\1" * 64, allocation_size=256 * 64)
    try:
        with Client(server.address, client_name="gpu-aux") as kv:
            with pytest.raises(InvalidArgument, match=r"aux_regions\[0\]\.region.*host memory"):
                aux = [AuxSpec("meta", fake_gpu, 256, 64)]
                kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions, aux=aux)
            assert len(server.node.buffers) == 0, "a refused registration left a buffer set behind"
            assert server.node.buffers.importer.open_mappings == 0, "a refused registration left a mapping"
    finally:
        pool.close()
