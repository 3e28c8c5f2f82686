"""``kvservice top``: the status tables, refreshed in place (rich ``Live`` on the alternate
screen) until q, Ctrl-C or ``--iterations`` refreshes.

One client (one session) for the whole run; peers' round trips are measured at every refresh.
A refresh that fails (the service restarting) shows the error and the next one tries again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator

from kvservice_client import KVClientError
from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from ._connect import client_of, default_address
from ._render import render

__all__ = ["run_top"]


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """Unbuffered stdin while inside (so 'q' needs no Enter); yields whether keys can be read."""
    if not sys.stdin.isatty():
        yield False
        return
    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _quit_pressed(wait_s: float) -> bool:
    """Wait up to ``wait_s`` for a key on stdin; True when it was q/Q."""
    ready, _, _ = select.select([sys.stdin], [], [], max(wait_s, 0.0))
    return bool(ready) and os.read(sys.stdin.fileno(), 1) in (b"q", b"Q")


def run_top(ns: argparse.Namespace) -> int:
    address = ns.address or default_address()
    footer = Text(f"refresh {ns.interval:g} s · q or Ctrl-C quits", style="dim")
    with client_of(ns, "kvservice-top") as kv, _keys() as keys:
        with Live(Text("connecting…"), screen=not ns.no_screen, auto_refresh=False) as live:
            n = 0
            try:
                while ns.iterations <= 0 or n < ns.iterations:
                    t0 = time.monotonic()
                    view: RenderableType
                    try:
                        stats = kv.get_stats(window_ms=int(ns.window * 1000), probe_peers=True)
                        view = render(stats, address)
                    except KVClientError as exc:
                        view = Text(f"{address}: {type(exc).__name__}: {exc}", style="red")
                    live.update(Group(view, footer), refresh=True)
                    n += 1
                    wait = ns.interval - (time.monotonic() - t0)
                    if keys and _quit_pressed(wait):
                        break
                    if not keys:
                        time.sleep(max(wait, 0.0))
            except KeyboardInterrupt:
                pass
    return 0
