"""A stand-in for the names ``kvservice_sglang.conn`` imports from SGLang 0.5.23
(``sglang.srt.disaggregation.base.conn``), so the backend's classes run where SGLang is not installed.

Only what the backend touches: the base classes it subclasses (no behaviour of their own that it
uses), ``KVArgs`` (attributes the caller sets), ``KVPoll`` (SGLang's values) and
``KVTransferMetric``. The contract tests in clients/sglang/tests run against the real package.
"""

from __future__ import annotations

import dataclasses
import sys
import types

__all__ = ["install", "uninstall"]

NAMES = (
    "sglang",
    "sglang.srt",
    "sglang.srt.disaggregation",
    "sglang.srt.disaggregation.base",
    "sglang.srt.disaggregation.base.conn",
)


class KVPoll:
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class KVArgs:
    """SGLang fills these attributes from its pools; tests set them."""


@dataclasses.dataclass
class KVTransferMetric:
    transfer_latency_s: float | None = None
    transfer_total_bytes: int | None = None


class BaseKVManager:
    pass


class BaseKVSender:
    pass


class BaseKVReceiver:
    pass


class BaseKVBootstrapServer:
    pass


def install() -> list[str]:
    """Put the stand-in modules in ``sys.modules``; the names added (for :func:`uninstall`)."""
    added = []
    for name in NAMES:
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            added.append(name)
    conn = sys.modules[NAMES[-1]]
    for cls in (
        KVPoll,
        KVArgs,
        KVTransferMetric,
        BaseKVManager,
        BaseKVSender,
        BaseKVReceiver,
        BaseKVBootstrapServer,
    ):
        setattr(conn, cls.__name__, cls)
    return added


def uninstall(added: list[str]) -> None:
    for name in added:
        sys.modules.pop(name, None)
