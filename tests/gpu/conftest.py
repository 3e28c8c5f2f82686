"""GPU tests run in-process services with the loopback transport unless they start their own
(``kvservice_procs``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kvservice_procs(
    tmp: Path, names: tuple[str, ...], **env: str
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Start one kvservice process per name on a Unix socket under ``tmp`` (``env`` adds or
    overrides settings); return them and their addresses once every socket exists."""
    full = {
        **os.environ,
        "KVSERVICE_LOG_FORMAT": "text",
        "KVSERVICE_VRAM_STAGING_MB": "256",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "clients/python"), os.environ.get("PYTHONPATH", "")]
        ),
        **env,
    }
    procs, socks = [], []
    for name in names:
        sock = tmp / f"{name}.sock"
        procs.append(
            subprocess.Popen([sys.executable, "-m", "kvservice", "--uds-path", str(sock)], cwd=ROOT, env=full)
        )
        socks.append(f"unix:{sock}")
    end = time.monotonic() + 60
    for s in socks:
        while not os.path.exists(s[5:]):
            assert time.monotonic() < end, "services did not start"
            time.sleep(0.1)
    return procs, socks
