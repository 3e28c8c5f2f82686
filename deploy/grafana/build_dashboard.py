"""Writes ``kvservice.json`` (the Grafana dashboard) from the panel list below.

    python deploy/grafana/build_dashboard.py          # rewrite kvservice.json (and the chart's copy)
    python deploy/grafana/build_dashboard.py --check  # exit 1 if either is stale

Every query filters ``instance=~"$instance"`` and uses ``$__rate_interval``; the test
``tests/deploy/test_dashboard_prometheus.py`` runs each of them against a real Prometheus.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvservice.json")
# The Helm chart ships a copy (charts cannot read files outside their directory).
COPIES = (OUT, Path(__file__).parents[1] / "helm" / "kvservice" / "dashboards" / "kvservice.json")
SEL = 'instance=~"$instance"'
RI = "$__rate_interval"
RECV = 'role="receiver"'


def _rate(metric: str, extra: str = "") -> str:
    sel = f"{SEL},{extra}" if extra else SEL
    return f"rate({metric}{{{sel}}}[{RI}])"


def _q(q: float, metric: str, by: str, extra: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({_rate(metric + '_bucket', extra)}))"


def _t(expr: str, legend: str) -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend}


# (title, unit, description, targets, width)
Panel = tuple[str, str, str, list[dict[str, Any]], int]

ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Transfer latency",
        [
            (
                "p50 by phase",
                "s",
                "Median time a transfer spends per phase (summed over its chunks).",
                [_t(_q(0.5, "kvservice_transfer_phase_seconds", "role, phase"), "{{role}} {{phase}}")],
                12,
            ),
            (
                "p99 by phase",
                "s",
                "Tail time per phase; compare with p50 to see which phase the tail comes from.",
                [_t(_q(0.99, "kvservice_transfer_phase_seconds", "role, phase"), "{{role}} {{phase}}")],
                12,
            ),
            (
                "End-to-end by path (done)",
                "s",
                "Declaration/first chunk to DONE, by data path.",
                [
                    _t(
                        _q(0.5, "kvservice_transfer_duration_seconds", "role, path", 'state="done"'),
                        "p50 {{role}} {{path}}",
                    ),
                    _t(
                        _q(0.99, "kvservice_transfer_duration_seconds", "role, path", 'state="done"'),
                        "p99 {{role}} {{path}}",
                    ),
                ],
                12,
            ),
            (
                "Descriptors per transfer",
                "short",
                "Transport descriptors one transfer side posted (packed: few).",
                [
                    _t(_q(0.5, "kvservice_transfer_descriptors", "role, path"), "p50 {{role}} {{path}}"),
                    _t(_q(0.99, "kvservice_transfer_descriptors", "role, path"), "p99 {{role}} {{path}}"),
                ],
                12,
            ),
        ],
    ),
    (
        "Throughput and prefix reuse",
        [
            (
                "Throughput",
                "Bps",
                "KV bytes moved by finished transfers per second.",
                [_t(f"sum by (role) ({_rate('kvservice_transfer_bytes_total')})", "{{role}}")],
                8,
            ),
            (
                "Bytes saved by prefix reuse",
                "Bps",
                "Bytes the receiver already held (skipped pages x page bytes), per second.",
                [_t(f"sum({_rate('kvservice_transfer_skipped_bytes_total', RECV)})", "saved")],
                8,
            ),
            (
                "Share of bytes saved",
                "percentunit",
                "saved / (saved + moved), receiver side.",
                [
                    _t(
                        f"sum({_rate('kvservice_transfer_skipped_bytes_total', RECV)}) / "
                        f"(sum({_rate('kvservice_transfer_skipped_bytes_total', RECV)}) + "
                        f"sum({_rate('kvservice_transfer_bytes_total', RECV)}))",
                        "saved share",
                    )
                ],
                8,
            ),
            (
                "Pages sent and skipped",
                "short",
                "Pages per second.",
                [
                    _t(f"sum by (role) ({_rate('kvservice_transfer_pages_sent_total')})", "sent {{role}}"),
                    _t(
                        f"sum by (role) ({_rate('kvservice_transfer_pages_skipped_total')})",
                        "skipped {{role}}",
                    ),
                ],
                12,
            ),
            (
                "Transfers by outcome",
                "ops",
                "Transfer sides ending per second, by state.",
                [_t(f"sum by (role, state) ({_rate('kvservice_transfers_total')})", "{{role}} {{state}}")],
                12,
            ),
        ],
    ),
    (
        "Failures, queues and staging",
        [
            (
                "Failures by reason",
                "ops",
                "FAILED/ABORTED transfer sides per second, by error code.",
                [
                    _t(
                        f"sum by (role, error_code) ({_rate('kvservice_transfer_failures_total')})",
                        "{{role}} {{error_code}}",
                    )
                ],
                8,
            ),
            (
                "In-flight transfers",
                "short",
                "Transfer sides not yet terminal.",
                [
                    _t(
                        f"sum by (instance, role) (kvservice_transfers_in_flight{{{SEL}}})",
                        "{{instance}} {{role}}",
                    )
                ],
                8,
            ),
            (
                "Send queue depth",
                "short",
                "Chunks queued or moving towards each destination service.",
                [
                    _t(
                        f"sum by (instance, peer) (kvservice_send_queue_depth{{{SEL}}})",
                        "{{instance}} → {{peer}}",
                    )
                ],
                8,
            ),
            (
                "Staging use",
                "percentunit",
                "Used / capacity per staging pool.",
                [
                    _t(
                        f"sum by (instance, pool) (kvservice_staging_used_bytes{{{SEL}}}) / "
                        f"sum by (instance, pool) (kvservice_staging_capacity_bytes{{{SEL}}})",
                        "{{instance}} {{pool}}",
                    )
                ],
                12,
            ),
            (
                "Staging waiters",
                "short",
                "Reservations waiting for staging space (back-pressure).",
                [
                    _t(
                        f"sum by (instance, pool) (kvservice_staging_waiters{{{SEL}}})",
                        "{{instance}} {{pool}}",
                    )
                ],
                12,
            ),
        ],
    ),
    (
        "Prefix index",
        [
            (
                "Index size",
                "short",
                "Pages indexed and live leases.",
                [
                    _t(f"sum by (instance) (kvservice_index_entries{{{SEL}}})", "entries {{instance}}"),
                    _t(f"sum by (instance) (kvservice_index_leases{{{SEL}}})", "leases {{instance}}"),
                ],
                8,
            ),
            (
                "Index hit rate",
                "percentunit",
                "Pages found / pages asked, over all lookups.",
                [
                    _t(
                        f"sum({_rate('kvservice_index_hit_pages_total')}) / "
                        f"sum({_rate('kvservice_index_query_pages_total')})",
                        "hit rate",
                    )
                ],
                8,
            ),
            (
                "Lookup latency (MatchPrefix)",
                "s",
                "MatchPrefix handling time, hashing included.",
                [
                    _t(_q(0.5, "kvservice_rpc_duration_seconds", "method", 'method="MatchPrefix"'), "p50"),
                    _t(_q(0.99, "kvservice_rpc_duration_seconds", "method", 'method="MatchPrefix"'), "p99"),
                ],
                8,
            ),
        ],
    ),
    (
        "RPC",
        [
            (
                "RPC latency p99 by method",
                "s",
                "Unary-response RPCs (streams are counted, not timed).",
                [_t(_q(0.99, "kvservice_rpc_duration_seconds", "service, method"), "{{service}}/{{method}}")],
                12,
            ),
            (
                "RPC rate by method and code",
                "ops",
                "Finished RPCs per second.",
                [
                    _t(
                        f"sum by (method, code) ({_rate('kvservice_rpc_handled_total')})",
                        "{{method}} {{code}}",
                    )
                ],
                12,
            ),
        ],
    ),
]


def _panel(pid: int, x: int, y: int, p: Panel) -> dict[str, Any]:
    title, unit, desc, targets, width = p
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10}},
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {**t, "refId": chr(ord("A") + i), "datasource": {"type": "prometheus", "uid": "${datasource}"}}
            for i, t in enumerate(targets)
        ],
    }


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row_title, row in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x = pid + 1, y + 1, 0
        for p in row:
            if x + p[4] > 24:
                x, y = 0, y + 8
            panels.append(_panel(pid, x, y, p))
            pid, x = pid + 1, x + p[4]
        y += 8
    return {
        "uid": "kvservice",
        "title": "kvservice",
        "tags": ["kvservice"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "graphTooltip": 1,
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                },
                {
                    "name": "instance",
                    "type": "query",
                    "label": "Instance",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": "label_values(kvservice_build_info, instance)", "refId": "instance"},
                    "definition": "label_values(kvservice_build_info, instance)",
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".*",
                    "current": {},
                    "refresh": 2,
                    "sort": 1,
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    text = render()
    stale = [p for p in COPIES if not p.exists() or p.read_text() != text]
    if "--check" in sys.argv[1:]:
        sys.exit(f"stale: {', '.join(map(str, stale))}; run {__file__}" if stale else 0)
    for path in COPIES:
        path.write_text(text)
