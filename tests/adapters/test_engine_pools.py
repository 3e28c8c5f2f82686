"""vLLM- and SGLang-shaped pools through each adapter's own registration code, exchanging KV
byte-exact across engines, page sizes, page layouts and TP sizes (CPU: shared-memory pools, the
services in this process; tests/gpu/test_gpu_engine_pools.py runs the same exchanges on CUDA
with every pool in a process of its own). Neither vLLM nor SGLang is imported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "vllm"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "sglang"))
from tests.support.engine_pools import EXCHANGES, EnginePool, run_exchange


@pytest.fixture(params=["two-services", "same-service"])
def services(request, make_server):  # type: ignore[no-untyped-def]
    """two-services: the cross-node route (pack, wire, unpack); same-service: the fused copy."""
    if request.param == "same-service":
        s = make_server(transport="loopback")
        return s, s
    return make_server(transport="loopback", same_host_route="off"), make_server(
        transport="loopback", same_host_route="off"
    )


@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_engine_pools_exchange_kv_byte_exact(services, name: str) -> None:  # type: ignore[no-untyped-def]
    a, b = services

    def make(spec, address, pool_name):  # type: ignore[no-untyped-def]
        return EnginePool(spec, address, "cpu", pool_name)

    run_exchange(make, name, a.address, b.address, b.app.peer_address)
