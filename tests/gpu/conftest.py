"""GPU tests run in-process services with the loopback transport unless they start their own
(``kvservice_procs``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kvservice_procs(
    tmp: Path, names: tuple[str, ...], *, launcher: Sequence[str] = ("-m", "kvservice"), **env: str
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Start one kvservice process per name on a Unix socket under ``tmp`` (``env`` adds or
    overrides settings; end-to-end integrity is on, as in every test (issue 33), unless ``env``
    says ``KVSERVICE_TRANSFER_INTEGRITY="0"``; ``launcher``: the interpreter's arguments in
    place of ``-m kvservice``, e.g. a fault-injecting script); return them and their addresses
    once every socket exists."""
    full = {
        **os.environ,
        "KVSERVICE_LOG_FORMAT": "text",
        "KVSERVICE_VRAM_STAGING_MB": "256",
        "KVSERVICE_TRANSFER_INTEGRITY": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "clients/python"), os.environ.get("PYTHONPATH", "")]
        ),
        **env,
    }
    procs, socks = [], []
    for name in names:
        sock = tmp / f"{name}.sock"
        procs.append(
            subprocess.Popen([sys.executable, *launcher, "--uds-path", str(sock)], cwd=ROOT, env=full)
        )
        socks.append(f"unix:{sock}")
    end = time.monotonic() + 60
    for s in socks:
        while not os.path.exists(s[5:]):
            assert time.monotonic() < end, "services did not start"
            time.sleep(0.1)
    return procs, socks
