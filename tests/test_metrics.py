"""kvservice.metrics: transfer observations, scrape-time gauges, the RPC interceptor, /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kvservice.metrics import Metrics, TransferMetrics, metrics_host
from kvservice.node import build_node
from tests.support.poll import eventually
from tests.support.services import ServerThread, make_config


@dataclasses.dataclass
class FakeRecord:
    transfer_id: str = "t"
    role: str = "RECEIVER"
    buffer_set_id: str = "bs"
    state: str = "DONE"
    bytes_sent: int = 4096
    pages_sent: int = 4
    pages_skipped: int = 3
    descriptors: int = 2
    path: str = "PACKED"
    timings_us: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"queue": 0, "plan": 10, "pack": 200, "wire": 3000, "unpack": 0}
    )
    error_code: str = ""
    total_us: int = 5000
    route_note: str = ""
    lane_told: bool = False


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def test_transfer_observe_counts_bytes_pages_and_skipped_bytes() -> None:
    """A DONE record adds its bytes, pages and skipped pages x page bytes."""
    reg = CollectorRegistry()
    m = TransferMetrics(reg, page_bytes=lambda bs: 512 if bs == "bs" else 0)
    m.observe(FakeRecord())  # type: ignore[arg-type]
    assert _value(reg, "kvservice_transfer_bytes_total", role="receiver") == 4096
    assert _value(reg, "kvservice_transfer_pages_sent_total", role="receiver") == 4
    assert _value(reg, "kvservice_transfer_pages_skipped_total", role="receiver") == 3
    assert _value(reg, "kvservice_transfer_skipped_bytes_total", role="receiver") == 3 * 512
    assert _value(reg, "kvservice_transfers_total", role="receiver", state="done") == 1
    assert (
        _value(reg, "kvservice_transfer_duration_seconds_sum", role="receiver", path="packed", state="done")
        == 0.005
    )


def test_transfer_sides_are_counted_by_the_route_that_moved_them() -> None:
    """The native lanes' transfers and the gRPC route's are told apart (every series exists at 0)."""
    reg = CollectorRegistry()
    m = TransferMetrics(reg)
    assert _value(reg, "kvservice_transfers_by_route_total", role="sender", route="lane") == 0
    for note in ("lane", "cross-node lane", "", "another host"):
        m.observe(FakeRecord(route_note=note))  # type: ignore[arg-type]
    m.observe(FakeRecord(lane_told=True))  # type: ignore[arg-type]  # a same-node lane side
    got = {
        r: _value(reg, "kvservice_transfers_by_route_total", role="receiver", route=r)
        for r in ("lane", "cross_node_lane", "grpc")
    }
    assert got == {"lane": 2, "cross_node_lane": 1, "grpc": 2}, got


def test_transfer_observe_skips_phases_that_did_not_run() -> None:
    """Only phases with time spent are observed (pack on direct transfers would drag p50 to 0)."""
    reg = CollectorRegistry()
    TransferMetrics(reg).observe(FakeRecord())  # type: ignore[arg-type]
    assert _value(reg, "kvservice_transfer_phase_seconds_count", role="receiver", phase="wire") == 1
    assert _value(reg, "kvservice_transfer_phase_seconds_sum", role="receiver", phase="wire") == 0.003
    assert _value(reg, "kvservice_transfer_phase_seconds_count", role="receiver", phase="queue") is None


def test_transfer_failures_are_labelled_by_error_code() -> None:
    """FAILED/ABORTED records count under their error code."""
    reg = CollectorRegistry()
    m = TransferMetrics(reg)
    m.observe(FakeRecord(state="FAILED", error_code="DEADLINE_EXCEEDED"))  # type: ignore[arg-type]
    m.observe(FakeRecord(state="ABORTED", error_code="ABORTED", role="SENDER"))  # type: ignore[arg-type]
    assert (
        _value(reg, "kvservice_transfer_failures_total", role="receiver", error_code="DEADLINE_EXCEEDED") == 1
    )
    assert _value(reg, "kvservice_transfer_failures_total", role="sender", error_code="ABORTED") == 1
    assert _value(reg, "kvservice_transfers_total", role="receiver", state="done") == 0


def test_transfer_observe_never_raises() -> None:
    """A broken record is logged, not raised into the transfer's code path."""
    TransferMetrics(CollectorRegistry()).observe(FakeRecord(timings_us=None))  # type: ignore[arg-type]


def test_metrics_host_follows_the_tcp_address() -> None:
    """Loopback services keep /metrics on loopback; UDS-only ones listen on every interface."""
    assert metrics_host("127.0.0.1:0") == "127.0.0.1"
    assert metrics_host("[::1]:50051") == "::1"
    assert metrics_host("0.0.0.0:50051") == "0.0.0.0"
    assert metrics_host("") == "0.0.0.0"


def test_collector_reads_zero_before_the_engine_starts() -> None:
    """Scrapes work before App.start: in-flight reads zero, index gauges are present."""
    node = build_node(make_config(transport="loopback"), "127.0.0.1:0")
    try:
        text = Metrics(node).exposition().decode()
    finally:
        asyncio.run(node.close())
    assert 'kvservice_transfers_in_flight{role="sender"} 0.0' in text
    assert "kvservice_index_entries 0.0" in text
    assert "kvservice_build_info{" in text


def test_metrics_endpoint_serves_and_frees_its_port() -> None:
    """metrics_port=-1 binds a free loopback port, serves /metrics and stops serving on stop."""
    s = ServerThread(make_config(metrics_port=-1))
    port = s.app.metrics_port
    try:
        assert port > 0
        with grpc.insecure_channel(s.address) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        # NOTE: the server accounts a call after the client got its status: scrape until it shows
        want = 'kvservice_rpc_duration_seconds_count{method="Check",service="Health"} 2.0'

        def scraped() -> str | None:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return text if want in text else None

        text = eventually(scraped, timeout=5, what=want, interval=0.05)
    finally:
        s.stop()
    assert 'kvservice_rpc_handled_total{code="OK",method="Check",service="Health"} 1.0' in text
    assert 'kvservice_rpc_handled_total{code="NOT_FOUND",method="Check",service="Health"} 1.0' in text
    assert 'kvservice_rpc_duration_seconds_count{method="Check",service="Health"} 2.0' in text
    with pytest.raises(ConnectionRefusedError):  # the endpoint is gone with the service
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_metrics_off_by_default() -> None:
    """metrics_port=0 starts no HTTP server."""
    s = ServerThread(make_config())
    try:
        assert s.app.metrics_port == 0 and s.app.metrics is not None and s.app.metrics.http is None
    finally:
        s.stop()
