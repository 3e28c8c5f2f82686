"""Two real vLLM instances (prefill, decode), each beside its own metered kvservice: what the TP
end-to-end tests share (test_vllm_tp_e2e, test_vllm_tp_decode_e2e, test_vllm_mla_tp_e2e)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvservice_client import Layout

sys.path.insert(0, str(Path(__file__).parents[2] / "clients" / "vllm" / "e2e"))
from instance_proc import VLLM_PY, VllmInstance  # noqa: E402

from tests.support.services import MeteredService, admin_stats

__all__ = ["BLOCK", "HEADS", "PAGE_BYTES", "MeteredService", "layouts", "pp2", "prompt", "tp2", "vllm_pair"]

HEADS = ("page_layout", "local_kv_heads", "tp_rank", "tp_size")  # an MHA rank's layout, for layouts()
# the tiny MHA model vllm_instance.py builds ("build"): its block, and a page's bytes (both heads)
BLOCK = 32
PAGE_BYTES = 2 * 2 * BLOCK * 64 * 2 * 4  # layers x heads x tokens x dim x (K, V) x fp32


def pp2(**env: str) -> dict[str, str]:
    """An instance of two pipeline stages (one worker process each, one core each here)."""
    bind = "0|1" if (os.cpu_count() or 1) < 4 else "0-1|2-3"
    return {**env, "KVS_VLLM_PP": "2", "VLLM_CPU_OMP_THREADS_BIND": bind}


def tp2(**env: str) -> dict[str, str]:
    """An instance of two TP ranks; vLLM binds each CPU worker's OpenMP threads to cores: one
    core a rank on a 2-core machine."""
    bind = "0|1" if (os.cpu_count() or 1) < 4 else "0-1|2-3"
    return {**env, "KVS_VLLM_TP": "2", "VLLM_CPU_OMP_THREADS_BIND": bind}


def vllm_pair(
    d: Path, names: tuple[str, str], env_p: dict[str, str], env_d: dict[str, str], kind: str = "build"
) -> Iterator[dict[str, Any]]:
    """Build a model (``kind``: vllm_instance.py's build or build-mla) under ``d``, start a metered
    service and an instance for the prefill and the decode (services ``names``), yield
    ``{"p", "d", "svc_p", "svc_d"}``, stop them all."""
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PY} missing: CI must run scripts/setup-vllm-cpu.sh")
        pytest.skip(f"{VLLM_PY} missing (scripts/setup-vllm-cpu.sh)")
    model = str(d / "model")
    VllmInstance.build_model(model, kind)
    svc_p, svc_d = MeteredService(names[0]), MeteredService(names[1])
    svc_p.wait_ready()
    svc_d.wait_ready()
    p = VllmInstance(model, svc_p.address, d / "prefill.log", env=env_p)
    dec = VllmInstance(model, svc_d.address, d / "decode.log", env=env_d)
    try:
        p.ready()
        dec.ready()
        yield {"p": p, "d": dec, "svc_p": svc_p, "svc_d": svc_d}
    finally:
        p.stop()
        dec.stop()
        svc_p.stop()
        svc_d.stop()


def layouts(svc: MeteredService, *fields: str, per_layer: bool = False) -> list[tuple[Any, ...]]:
    """``fields`` of each buffer set's layout registered at ``svc``, sorted: each worker's whole
    cache, or (``per_layer``) the one-layer sets the connector registers beside it (engine id
    ``<engine>#L<layer>``, kvservice_vllm/layers.py)."""
    sets = admin_stats(svc.address).buffer_sets
    lays = [Layout.from_proto(b.layout) for b in sets if ("#L" in b.engine_id) == per_layer]
    return sorted(tuple(getattr(x, f) for f in fields) for x in lays)


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 13 + salt * 97) % 1000 + 3 for i in range(n)]
