"""The Grafana dashboard against a real Prometheus scraping two live services.

Two in-process services (loopback transport) run a transfer workload while a real
``prometheus`` binary scrapes their /metrics every second; then every PromQL query of
``deploy/grafana/kvservice.json`` goes to Prometheus's HTTP API and must return data.
Skips when the Debian package ``prometheus`` (which brings ``prometheus`` and ``promtool``)
is not installed. Loopback addresses only; every wait is bounded.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.metrics_workload import run_workload
from tests.support.poll import eventually
from tests.support.services import ServerThread, make_config

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvservice.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
RATE_WINDOW = "20s"

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus binary not found (apt-get install -y prometheus)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
        return bytes(r.read())


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target in the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def _instantiate(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$instance", ".*")


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[Any, Any]]:
    a = ServerThread(make_config(transport="loopback", metrics_port=-1))
    b = ServerThread(make_config(transport="loopback", metrics_port=-1))
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def prometheus(services: tuple[Any, Any], tmp_path_factory: Any) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("prom")
    targets = [f"127.0.0.1:{s.app.metrics_port}" for s in services]
    (tmp / "prometheus.yml").write_text(
        json.dumps(
            {  # JSON is YAML
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": "kvservice", "static_configs": [{"targets": targets}]}],
            }
        )
    )
    port = _free_port()
    proc = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "prometheus.log", "wb"),
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def not_started() -> str:
            return f"prometheus did not start: {(tmp / 'prometheus.log').read_text()[-2000:]}"

        def ready() -> bool:
            try:
                _get(f"{url}/-/ready", 1)
                return True
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(not_started())
                return False

        eventually(ready, timeout=20, what=not_started, interval=0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    body = json.loads(_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert body["status"] == "success", f"{expr}: {body}"
    return list(body["data"]["result"])


def test_every_dashboard_query_returns_data(services: tuple[Any, Any], prometheus: str) -> None:
    """Each PromQL target of the dashboard returns a non-empty result while transfers run."""
    a, b = services
    up = 'sum(up{job="kvservice"}) == 2'
    eventually(lambda: _query(prometheus, up), 15, f"data for {up}", interval=0.5)
    done = run_workload(a, b, seconds=12.0)
    assert done > 20, f"only {done} transfers completed"
    time.sleep(2.5)  # let the last samples be scraped
    empty, nan = [], []
    queries = dashboard_queries()
    for title, expr in queries:
        result = _query(prometheus, _instantiate(expr))
        if not result:
            empty.append(f"{title}: {expr}")
        elif all(r["value"][1] == "NaN" for r in result):
            nan.append(title)
    print(f"{len(queries)} dashboard queries, {done} transfers done, {len(empty)} empty, all-NaN: {nan}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert len(nan) <= len(queries) // 4, f"too many all-NaN panels: {nan}"


def test_metrics_exposition_passes_promtool(services: tuple[Any, Any]) -> None:
    """`promtool check metrics` finds nothing to complain about in our /metrics output."""
    if PROMTOOL is None:
        pytest.skip("promtool not found (apt-get install -y prometheus)")
    for s in services:
        text = _get(f"http://127.0.0.1:{s.app.metrics_port}/metrics")
        assert b"kvservice_transfer_phase_seconds_bucket" in text or b"kvservice_build_info" in text
        r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=30)
        assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
