"""kvservice instances in tests: in-process (``ServerThread`` on its own event loop thread, with
the tests' ``make_config``) and as processes (``ServiceProc``: ``python -m kvservice`` on a Unix
socket; ``MeteredService`` with /metrics)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvservice_client import Client

from kvservice.config import Config, with_options
from kvservice.node import Node
from kvservice.server import App, build_server

__all__ = [
    "FAULTY_LAUNCHER",
    "FAULTY_SERVICE",
    "SERVICE_MODULE",
    "MeteredService",
    "ServerThread",
    "ServiceProc",
    "admin_stats",
    "free_port",
    "free_ports",
    "make_config",
]


class ServerThread:
    """Runs an App on its own event loop in a background thread."""

    def __init__(self, config: Config) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.app: App = self.call(self._build(config))

    async def _build(self, config: Config) -> App:
        app = build_server(config)
        await app.start()
        return app

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 0.5) -> None:
        self.call(self.app.stop(grace_s))
        try:  # its worker threads too: a test run starts hundreds of services
            self.call(self.loop.shutdown_default_executor(), timeout=10)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    @property
    def address(self) -> str:
        return self.app.address

    @property
    def node(self) -> Node:
        return self.app.node


def make_config(**overrides: Any) -> Config:
    d = tempfile.mkdtemp(prefix="kvs-")
    """A valid Config for an in-process test service; ``overrides`` by option (flag) name."""
    base = with_options(
        Config(),
        uds_path=os.path.join(d, "kv.sock"),
        tcp_address="127.0.0.1:0",
        insecure=True,
        log_format="text",
        transfer_integrity=True,  # on in tests, off by default
    )
    return with_options(base, **overrides).validate()


# -- service processes (python -m kvservice, NIXL) -------------------------------------------
# NOTE: end-to-end integrity is on in tests, as for in-process services (make_config); its default
# (off) stays what benchmarks and production run.
SERVICE_MODULE = (sys.executable, "-m", "kvservice")
FAULTY_SERVICE = Path(__file__).with_name("faulty_service.py")  # the service with a fault injected
FAULTY_LAUNCHER = (sys.executable, str(FAULTY_SERVICE))


class ServiceProc:
    """A ``python -m kvservice`` process on a Unix socket in a fresh temporary directory
    (``netns``: run it in that network namespace; ``env``: extra environment; ``integrity``:
    transfer_integrity on (the tests' default) or off, None: as the environment says (the
    service's default: benchmarks); ``launcher``: the command in place of ``python -m kvservice``,
    e.g. ``FAULTY_LAUNCHER``)."""

    def __init__(
        self,
        name: str,
        *args: str,
        netns: str = "",
        env: dict[str, str] | None = None,
        integrity: bool | None = True,
        launcher: Sequence[str] = SERVICE_MODULE,
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"kvs-e2e-{name}-")
        self.sock = os.path.join(self.dir, "kv.sock")
        self.address = f"unix:{self.sock}"
        self.log = open(os.path.join(self.dir, "log"), "w+b")
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.argv = [
            *prefix,
            *launcher,
            "--uds-path",
            self.sock,
            "--log-format",
            "text",
            "--log-level",
            "WARNING",
            *args,
        ]
        chosen = {} if integrity is None else {"KVSERVICE_TRANSFER_INTEGRITY": "1" if integrity else "0"}
        self.env = {**os.environ, **chosen, **(env or {})}
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)

    def restart(self) -> None:
        """SIGKILL the process and start it again on the same socket (a crashed, restarted service)."""
        self.kill()
        self.proc = self._start()
        self.wait_ready()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_ready(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not _answers(self.sock):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvservice exited {self.proc.returncode}: {self.output()}")
            if time.monotonic() > end:
                raise RuntimeError(f"kvservice not up within {timeout}s: {self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def admin_stats(address: str) -> Any:
    """GetStats as an admin session (this test runs as the service's uid): buffer sets of every
    session are listed (a call without a session lists none). ``sessions`` counts this one too."""
    with Client(address, client_name="admin-stats", timeout=5) as kv:
        assert kv.session_id
        return kv.get_stats()


def _answers(sock: str) -> bool:
    """The service's socket exists and accepts (a killed one's file may still be there)."""
    if not os.path.exists(sock):
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(sock)
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MeteredService(ServiceProc):
    """A service process with /metrics on a free port; :meth:`moved` reads its transfer counters."""

    COUNTERS = ("bytes", "pages_sent", "pages_skipped", "skipped_bytes")

    def __init__(self, name: str, *args: str, **kw: Any) -> None:
        self.metrics_port = free_port()
        super().__init__(name, "--metrics-port", str(self.metrics_port), *args, **kw)

    def moved(self, role: str = "receiver") -> dict[str, float]:
        """``kvservice_transfer_{bytes,pages_sent,pages_skipped,skipped_bytes}_total`` of ``role``
        (one scrape)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        wanted = {f"kvservice_transfer_{k}_total": k for k in self.COUNTERS}
        out = {
            wanted[smp.name]: float(smp.value)
            for fam in text_string_to_metric_families(text)
            for smp in fam.samples
            if smp.name in wanted and smp.labels.get("role") == role
        }
        missing = set(self.COUNTERS) - set(out)
        if missing:
            raise AssertionError(f"{sorted(missing)} not in /metrics")
        return out

    def routes(self, role: str = "receiver") -> dict[str, float]:
        """``kvservice_transfers_by_route_total`` of ``role``: finished sides by route (one scrape)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {
            smp.labels["route"]: float(smp.value)
            for fam in text_string_to_metric_families(text)
            for smp in fam.samples
            if smp.name == "kvservice_transfers_by_route_total" and smp.labels.get("role") == role
        }

    def sums(self, *names: str) -> dict[str, float]:
        """Each sample name's value summed over its labels (0 when absent), one scrape."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        out = dict.fromkeys(names, 0.0)
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name in out:
                    out[smp.name] += float(smp.value)
        return out
