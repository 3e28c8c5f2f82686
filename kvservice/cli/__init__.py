"""Command line: ``kvservice serve [flags]`` (also ``python -m kvservice``), ``kvservice demo``,
``kvservice health``, and the operator's ``kvservice status`` (one shot, ``--json``) and
``kvservice top`` (refreshing).

One module per command that has more than a few lines: ``_status``, ``_top`` (both draw with
``_render``, both connect through ``_connect``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from ..config import ConfigError, add_flags, load_config
from ..log import setup_logging
from ._connect import add_connect_flags, default_address

__all__ = ["main"]


def _run(coro: object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:  # uvloop is a dependency; keep running where it cannot be installed
        asyncio.run(coro)  # type: ignore[arg-type]


def _health(address: str, timeout: float) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    return 0 if status == "SERVING" else 1


def _credential(address: str) -> int:
    from kvservice_client.contract import fetch_credential, find_credential_path

    token = fetch_credential(find_credential_path(address, None))
    if not token:
        print(f"kvservice credential: no credential socket beside {address}", file=sys.stderr)
        return 1
    print(token)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvservice", description="KV-cache transfer service")
    sub = parser.add_subparsers(dest="command")
    serve_p = sub.add_parser("serve", help="run the service (default)")
    add_flags(serve_p)
    demo_p = sub.add_parser("demo", help="multi-turn transfer demo: two services, two engines, shm")
    demo_p.add_argument("--turns", type=int, default=4)
    demo_p.add_argument(
        "--same-host",
        action="store_true",
        help="let the two services use the same-host fused route (default: they act as two nodes, NIXL)",
    )
    health_p = sub.add_parser("health", help="exit 0 if the service at --address is SERVING")
    health_p.add_argument("--address", required=True, help='"unix:/path" or "host:port"')
    health_p.add_argument("--timeout", type=float, default=3.0)
    status_p = sub.add_parser("status", help="the node's state once: engines, transfers, peers, sessions")
    add_connect_flags(status_p)
    status_p.add_argument("--json", action="store_true", help="print the GetStats response as JSON")
    status_p.add_argument("--window", type=float, default=10.0, help="seconds of recent activity")
    top_p = sub.add_parser("top", help="the node's state, refreshed in the terminal (q quits)")
    add_connect_flags(top_p)
    top_p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top_p.add_argument("--window", type=float, default=10.0, help="seconds of recent activity")
    top_p.add_argument("--iterations", "-n", type=int, default=0, help="stop after N refreshes (0: never)")
    top_p.add_argument(
        "--no-screen", action="store_true", help="draw in the scrollback, not the alternate screen"
    )
    cred_p = sub.add_parser(
        "credential",
        help="print one single-use kvservice-credential for this uid (for grpcurl -H; see README)",
    )
    cred_p.add_argument("--address", default=None, help='"unix:/path" (default: the default socket)')
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv.insert(0, "serve")
    ns = parser.parse_args(argv)
    if ns.command == "status":
        from ._status import run_status

        return run_status(ns)
    if ns.command == "top":
        from ._top import run_top

        return run_top(ns)
    if ns.command == "credential":
        return _credential(ns.address or default_address())
    if ns.command == "health":
        return _health(ns.address, ns.timeout)
    if ns.command == "demo":
        from ..demo import run_demo

        return run_demo(turns=ns.turns, same_host=ns.same_host)
    try:
        config = load_config(vars(ns), yaml_path=ns.config)
    except ConfigError as exc:
        print(f"kvservice: invalid configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.observability.log_level, config.observability.log_format)
    if (
        config.data_plane.cache_dir
    ):  # before anything JIT-compiled is imported (see kvservice_client.jit_cache)
        os.environ["KVSERVICE_CACHE_DIR"] = config.data_plane.cache_dir
    if config.data_plane.native_dir:  # read by kvservice.transfer.lane.native
        os.environ["KVSERVICE_NATIVE_DIR"] = config.data_plane.native_dir
    from kvservice_client import jit_cache

    jit_cache.configure()
    from ..server import serve

    _run(serve(config))
    return 0
