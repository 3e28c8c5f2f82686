"""kvservice as a vLLM KV connector (``KVConnectorBase_V1``), loaded out of tree::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVServiceConnector",
        "kv_connector_module_path": "kvservice_vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvservice_address": "unix:/run/kvservice/kv.sock"}}'

A prefill request carries ``kv_transfer_params={"do_remote_decode": true, "kvservice_peer":
"<decode's kvservice host:port>", "transfer_id": "<id>"}``; its response's params go to the decode
instance as they are. Only the pages the decode instance does not hold already move.

The connector (which imports vLLM) loads on first use: ``kvservice_vllm.layout`` and
``kvservice_vllm.worker`` import without the engine package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import KVServiceConnector

__all__ = ["KVServiceConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVServiceConnector":  # vLLM: getattr(import_module("kvservice_vllm"), name)
        from .connector import KVServiceConnector

        return KVServiceConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
