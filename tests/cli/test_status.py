"""``kvservice status``: one shot, tables for people and ``--json`` for scripts, against a live
service (as a subprocess, the way an operator runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvservice_client import Client, Layout, ShmKVPool

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=8, total_kv_heads=2, head_dim=8, dtype="float16")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "clients", "python")])}
    return subprocess.run(
        [sys.executable, "-m", "kvservice", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_status_json_is_the_whole_node_for_an_admin(server) -> None:
    """--json prints GetStats with proto field names; root over the socket sees every engine."""
    with ShmKVPool.create(LAYOUT) as pool, Client(server.address, client_name="decode-0") as kv:
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions, engine_id="decode-0").buffer_set_id
        out = _cli("status", "--json", "--address", server.address)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["admin_view"] is True and doc["scope_note"] == ""
    assert [(b["buffer_set_id"], b["engine_id"]) for b in doc["buffer_sets"]] == [(bs, "decode-0")]
    assert {s["client_name"] for s in doc["session_list"]} == {"decode-0", "kvservice-status"}
    assert doc["service_id"] == server.node.service_id and "activity" in doc and "staging" in doc


def test_status_tables_name_each_concern(server) -> None:
    """Without --json: a header and one table per concern, the engine listed by name."""
    with ShmKVPool.create(LAYOUT) as pool, Client(server.address) as kv:
        kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions, engine_id="prefill-7")
        out = _cli("status", "--address", server.address)
    assert out.returncode == 0, out.stderr
    for heading in ("admin view", "Routes", "In flight by phase", "Engines", "Staging", "Peers", "Sessions"):
        assert heading in out.stdout
    assert "prefill-7" in out.stdout and server.node.service_id in out.stdout


def test_status_of_an_unreachable_service_exits_1_and_says_why() -> None:
    """No service at the address: exit status 1 and the reason on stderr, nothing on stdout."""
    out = _cli("status", "--address", "unix:/nonexistent/kv.sock", "--timeout", "1")
    assert out.returncode == 1 and out.stdout == ""
    assert "kvservice status:" in out.stderr


def test_status_without_an_address_asks_the_default_socket(tmp_path) -> None:
    """No --address: the service's default socket ($KVSERVICE_UDS_PATH here), named in the
    reason when nobody listens there (not a crash reading the config)."""
    sock = str(tmp_path / "none.sock")
    env = {k: v for k, v in os.environ.items() if k != "KVSERVICE_ADDRESS"}
    env |= {
        "KVSERVICE_UDS_PATH": sock,
        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "clients", "python")]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "kvservice", "status", "--timeout", "1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 1 and out.stdout == "", out
    assert f"unix:{sock}" in out.stderr and "Traceback" not in out.stderr, out.stderr
