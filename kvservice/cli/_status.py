"""``kvservice status``: one GetStats, printed as tables or (``--json``) as the response itself."""

from __future__ import annotations

import argparse
import json
import os
import sys

from google.protobuf.json_format import MessageToDict
from kvservice_client import KVClientError
from rich.console import Console

from ._connect import client_of, default_address
from ._render import render

__all__ = ["run_status"]


def run_status(ns: argparse.Namespace) -> int:
    """Exit 0 with the node's state on stdout; 1 (and why, on stderr) when it cannot be read."""
    try:
        with client_of(ns, "kvservice-status") as kv:
            stats = kv.get_stats(window_ms=int(ns.window * 1000))
    except KVClientError as exc:
        print(f"kvservice status: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if ns.json:
        # NOTE: proto field names and every field, zeros included: scripts index keys, not guesses.
        doc = MessageToDict(
            stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        try:
            json.dump(doc, sys.stdout, indent=2, sort_keys=True)
            sys.stdout.write("\n")
            sys.stdout.flush()
        except BrokenPipeError:  # `| head`: the reader had enough
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    console = Console()
    if not console.is_terminal:  # a file or a pipe: full rows, no wrapping at 80 columns
        console = Console(width=160)
    console.print(render(stats, ns.address or default_address()))
    return 0
