"""kvservice as an SGLang PD-disaggregation transfer backend (sglang 0.5.23).

SGLang picks backends from a fixed enum, so run it through the launcher, which adds ``kvservice``::

    python -m kvservice_sglang.launch_server --model-path M --disaggregation-mode prefill \\
        --disaggregation-transfer-backend kvservice ...

Environment: ``SGLANG_KVSERVICE_ADDRESS`` (the local service, default ``unix:/tmp/kvservice-<uid>.sock``),
``SGLANG_KVSERVICE_PEER_ADDRESS`` (the address other nodes' services reach it at; a decode instance
publishes it to the prefill's bootstrap server, default ``SGLANG_KVSERVICE_ADDRESS``; a prefill's
bootstrap server names it as the sender, default what the service says it is),
``SGLANG_KVSERVICE_DEADLINE_MS`` (30000), ``SGLANG_KVSERVICE_LANDING_TTL_MS`` (decode; 0, the
default, is off: > 0 lands a request's pages and metadata rows in the service's landing pool
before SGLang allocates, and claims them then).

The classes (which import SGLang) load on first use: ``kvservice_sglang.regions`` (the pools'
registration) imports without the engine package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .conn import (
        KVServiceBootstrapServer,
        KVServiceManager,
        KVServiceReceiver,
        KVServiceSender,
        KVServiceTransferError,
    )

__all__ = [
    "KVServiceBootstrapServer",
    "KVServiceManager",
    "KVServiceReceiver",
    "KVServiceSender",
    "KVServiceTransferError",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import conn

        return getattr(conn, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
