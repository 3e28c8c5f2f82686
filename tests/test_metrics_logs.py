"""Structured logs: every line about a transfer carries ``transfer_id``."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

from kvservice.log import JsonFormatter  # noqa: E402
from tests.support.metrics_workload import run_workload
from tests.support.services import ServerThread, make_config

TRANSFER_PKG = Path(__file__).parents[1] / "kvservice" / "transfer"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
# Lines in kvservice/transfer that are about the service, a peer, a lane connection or a buffer set,
# not one transfer: (path under kvservice/transfer, message).
NOT_ABOUT_A_TRANSFER = {
    ("peers.py", "peer restarted"),
    ("peer_channel.py", "peer channel broke"),  # the channel's transfers fail with their own lines
    ("peer_pools.py", "closing a peer pool mapping failed"),
    ("duplicates.py", "duplicate marks on %s/%s cleared: %s"),  # marks outlive their transfers
    ("duplicates.py", "duplicate mark check failed"),
    (  # once, at agent creation
        "nixl_transport.py",
        "nixl did not build its agent config through nixl._api.nixlBind: progress delay %d us "
        "not applied, its progress thread may spin a core",
    ),
    (  # once per pair of devices
        "routes/same_node.py",
        "no peer access from cuda:%d to cuda:%d: same-node copies between them go through host memory "
        "(the driver stages the link copy)",
    ),
    # the lane at start: on or off, and why (once per service)
    ("lane/__init__.py", "native lane serving"),
    ("lane/__init__.py", "native lane off: %s; same-node transfers use gRPC only"),
    ("lane/__init__.py", "native lane: no CUDA (%s); GPU pools use gRPC only"),
    ("lane/__init__.py", "native lane: copy kernel not compiled (%s); GPU pools use gRPC only"),
    ("lane/cross.py", "cross-node lane off: NIXL is not this service's transport"),
    ("lane/cross.py", "cross-node lane off: %s"),
    ("lane/cross.py", "cross-node lane: no staging on device %s: %s"),
    # a peer's lane (its transfers go over gRPC, each with its own lines)
    ("lane/cross.py", "cross-node lane: a peer's lane speaks another version: gRPC with it"),
    ("lane/cross.py", "cross-node lane: a peer's metadata did not load: %s"),
    (  # the lane's counters at shutdown, summed over its transfers
        "lane/cross.py",
        "cross-node lane: %d sent (pack %d, post %d, wait %d, ack %d µs each; %d re-posted), %d received "
        "(note %d, unpack %d µs each); %d CUDA copies (lock %d, sync %d µs each)",
    ),
    # an engine's lane connection: accept, hello, refusals (rate-limited; the message is its argument)
    ("lane/listener.py", ""),
    ("lane/listener.py", "lane hello failed: %s"),
    ("lane/book.py", "unhandled error in a lane call"),  # a call (request id), answered INTERNAL
    ("lane/book.py", "lane: a copy still holds an unregistered buffer set; its memory stays mapped"),
}


def _under_transfer(pathname: str) -> str:
    path = Path(pathname).resolve()
    return (
        path.relative_to(TRANSFER_PKG.resolve()).as_posix()
        if path.is_relative_to(TRANSFER_PKG.resolve())
        else ""
    )


def _log_calls(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in LEVELS
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id in ("log", "logger", "_log")
    ]


def _message(call: ast.Call) -> str:
    args = call.args[1:] if call.func.attr == "log" else call.args  # type: ignore[attr-defined]
    return args[0].value if args and isinstance(args[0], ast.Constant) else ""


def test_every_transfer_log_call_passes_transfer_id() -> None:
    """Each logging call in kvservice/transfer/ has extra={"transfer_id": ...} (or is allow-listed)."""
    missing = []
    for path in sorted(TRANSFER_PKG.rglob("*.py")):
        for call in _log_calls(path):
            if (path.relative_to(TRANSFER_PKG).as_posix(), _message(call)) in NOT_ABOUT_A_TRANSFER:
                continue
            extra = next((k.value for k in call.keywords if k.arg == "extra"), None)
            keys = (
                {k.value for k in extra.keys if isinstance(k, ast.Constant)}
                if isinstance(extra, ast.Dict)
                else set()
            )
            if "transfer_id" not in keys:
                missing.append(f"{path.relative_to(TRANSFER_PKG)}:{call.lineno} {_message(call)!r}")
    assert not missing, "log calls without transfer_id:\n" + "\n".join(missing)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_transfer_log_lines_carry_transfer_id_as_json() -> None:
    """During real transfers (done, failed, aborted) each transfer log line has transfer_id in its JSON."""
    cap = _Capture()
    logger = logging.getLogger("kvservice.transfer")
    old_level = logger.level
    logger.addHandler(cap)
    logger.setLevel(logging.DEBUG)
    a = ServerThread(make_config(transport="loopback"))
    b = ServerThread(make_config(transport="loopback"))
    try:
        assert run_workload(a, b, seconds=0.3) >= 1
    finally:
        a.stop()
        b.stop()
        logger.removeHandler(cap)
        logger.setLevel(old_level)
    lines = [
        json.loads(JsonFormatter().format(r))
        for r in cap.records
        if (_under_transfer(r.pathname), r.msg) not in NOT_ABOUT_A_TRANSFER
    ]
    assert any(line["msg"] == "transfer failed" for line in lines)
    assert any(line["msg"] == "transfer aborted" for line in lines)
    assert all(line.get("transfer_id") for line in lines), [
        line for line in lines if not line.get("transfer_id")
    ]
