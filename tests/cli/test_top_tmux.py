"""``kvservice top`` in a real terminal (tmux): it draws the live node while transfers run,
refreshes, and quits on q. The node is tests/cli/live_load.py in its own process."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.support.poll import eventually

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "clients", "python")])}

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")


@pytest.fixture
def live_node(tmp_path) -> Iterator[str]:
    """Address of a node with transfers running (stopped by deleting its address file)."""
    addr_file = str(tmp_path / "address")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "cli", "live_load.py"), addr_file, "300"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        eventually(lambda: os.path.exists(addr_file) or proc.poll() is not None, 60, "the live node", 0.1)
        assert os.path.exists(addr_file), "the live node did not start"
        yield open(addr_file).read()
    finally:
        if os.path.exists(addr_file):
            os.unlink(addr_file)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30, env=ENV).stdout


def _screen_with(session: str, words: tuple[str, ...], timeout: float = 60) -> str:
    """The session's screen once it shows every one of ``words``."""
    screen = [""]

    def shows() -> str:
        screen[0] = _tmux("capture-pane", "-p", "-t", session)
        return screen[0] if all(w in screen[0] for w in words) else ""

    return str(eventually(shows, timeout, lambda: f"never saw {words} on the screen:\n{screen[0]}", 0.3))


def test_top_shows_the_live_node_refreshes_and_quits_on_q(live_node: str) -> None:
    """Routes with rates, both engines, the peer READY with an RTT; the screen changes between
    refreshes; q ends it."""
    session = f"kvtop-{uuid.uuid4().hex[:8]}"
    cmd = shlex.join([sys.executable, "-m", "kvservice", "top", "--address", live_node, "--interval", "0.5"])
    _tmux(
        "new-session",
        "-d",
        "-s",
        session,
        "-x",
        "180",
        "-y",
        "60",
        f"env PYTHONPATH={ENV['PYTHONPATH']} {cmd}",
    )
    try:
        first = _screen_with(session, ("admin view", "sender/fused", "prefill-0", "decode-l", "READY", "ms"))
        assert "Peers" in first and "Sessions" in first and "q or Ctrl-C quits" in first
        assert "xfer/s" in first and "bytes/s" in first
        time.sleep(2.0)
        second = _tmux("capture-pane", "-p", "-t", session)
        assert second != first  # uptime and counters moved: it refreshes in place
        _tmux("send-keys", "-t", session, "q")
        eventually(
            lambda: session not in _tmux("list-sessions", "-F", "#{session_name}"), 15, "q to quit", 0.2
        )
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
