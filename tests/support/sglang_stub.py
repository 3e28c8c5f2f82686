"""A stand-in for the names ``kvservice_sglang.conn`` imports from SGLang 0.5.23
(``sglang.srt.disaggregation.base.conn``), so the backend's classes run where SGLang is not installed.

Only what the backend touches: the base classes it subclasses (no behaviour of their own that it
uses), ``KVArgs`` (attributes the caller sets), ``KVPoll`` (SGLang's values) and
``KVTransferMetric``. The contract tests in clients/sglang/tests run against the real package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
from collections.abc import Iterator

__all__ = ["backend_conn", "install", "uninstall"]

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


@contextlib.contextmanager
def backend_conn() -> Iterator[types.ModuleType]:
    """``kvservice_sglang.conn`` over the real SGLang when it is installed (required with
    ``KVS_SGLANG_REAL=1``, and then checked to be the package's own base classes), else over this
    stand-in, removed with the backend's modules afterwards."""
    real = os.environ.get("KVS_SGLANG_REAL") == "1"
    try:
        import sglang.srt.disaggregation.base.conn  # noqa: F401
    except ImportError:
        if real:
            raise
        added = install()
    else:
        added = []
    import kvservice_sglang.conn as c

    if real:
        for cls in (c.BaseKVSender, c.BaseKVReceiver):
            assert cls.__module__ == "sglang.srt.disaggregation.base.conn", cls
    try:
        yield c
    finally:
        if added:
            uninstall(added)
            for name in ("kvservice_sglang.conn", "kvservice_sglang"):
                sys.modules.pop(name, None)
