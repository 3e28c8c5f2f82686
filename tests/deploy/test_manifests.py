"""Static deploy files: compose, raw Kubernetes manifests, Prometheus/Grafana provisioning, dashboard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
SOCKET = "unix:/run/kvservice/kvservice.sock"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return dict(obj["spec"]["template"]["spec"])


def test_dashboard_is_generated_and_fresh() -> None:
    """kvservice.json (and the chart's copy) equal what build_dashboard.py writes."""
    r = subprocess.run(
        [sys.executable, str(DEPLOY / "grafana" / "build_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr


def test_dashboard_structure() -> None:
    """Unique panel ids; each target has a refId and a kvservice_ PromQL expr; rows fit 24 columns."""
    dash = json.loads((DEPLOY / "grafana" / "kvservice.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    targets = [t for p in dash["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 20
    for p in dash["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p.get("targets", []):
            assert t["refId"] and "kvservice_" in t["expr"] and "$instance" in t["expr"], t
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "instance"}


def test_compose_wires_services_engines_prometheus_and_grafana() -> None:
    """Compose: builds the root Dockerfile, mounts files that exist, shares sockets and IPC per pair."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    svcs = compose["services"]
    assert set(svcs) == {
        "kvservice-token",
        "kvservice-prefill",
        "kvservice-decode",
        "engine-prefill",
        "engine-decode",
        "prometheus",
        "grafana",
    }
    for node in ("prefill", "decode"):
        kv, engine = svcs[f"kvservice-{node}"], svcs[f"engine-{node}"]
        assert (DEPLOY / kv["build"]["context"] / kv["build"]["dockerfile"]).exists()
        assert engine["ipc"] == f"service:kvservice-{node}" and kv["ipc"] == "shareable"
        assert kv["volumes"][0] in engine["volumes"]
        assert SOCKET in engine["command"]
        assert kv["environment"]["KVSERVICE_METRICS_PORT"] == "9400"
        # trust: no engine TCP port; KVPeer on its own port with the one-shot's peer token
        env = kv["environment"]
        assert "KVSERVICE_TCP_ADDRESS" not in env and "KVSERVICE_INSECURE" not in env
        assert env["KVSERVICE_PEER_TOKEN_FILE"] == "/secrets/peer-token"
        assert "peer-token:/secrets:ro" in kv["volumes"]
        assert kv["depends_on"]["kvservice-token"] == {"condition": "service_completed_successfully"}
    assert "peer-token:/secrets" in svcs["kvservice-token"]["volumes"]
    assert (
        svcs["engine-prefill"]["command"][-1]
        == svcs["kvservice-decode"]["environment"]["KVSERVICE_ADVERTISE_ADDRESS"]
    )
    for svc in svcs.values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), vol
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["kvservice-prefill:9400", "kvservice-decode:9400"]


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    """The dashboard provider path is where compose mounts kvservice.json; the datasource is Prometheus."""
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvservice.yml").read_text())
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/kvservice.json:{prov['providers'][0]['options']['path']}/kvservice.json:ro" in mounts
    assert ds["datasources"][0]["type"] == "prometheus"


def test_k8s_daemonset_manifest() -> None:
    """Raw DaemonSet: hostIPC, hostPath socket dir, health probes on the socket, metrics annotations."""
    objs = {d["kind"]: d for d in _docs(DEPLOY / "k8s" / "daemonset.yaml")}
    assert set(objs) == {"ServiceAccount", "DaemonSet", "Service"}
    ds = objs["DaemonSet"]
    spec = _pod_spec(ds)
    assert spec["hostIPC"] is True
    assert any(v.get("hostPath", {}).get("path") == "/run/kvservice" for v in spec["volumes"])
    kv = spec["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert kv[probe]["exec"]["command"] == ["kvservice", "health", "--address", SOCKET]
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9400"


def test_k8s_sidecar_example() -> None:
    """Sidecar example: engine and kvservice share the socket emptyDir and /dev/shm."""
    (dep,) = _docs(DEPLOY / "k8s" / "sidecar-example.yaml")
    assert dep["kind"] == "Deployment"
    spec = _pod_spec(dep)
    names = [c["name"] for c in spec["containers"]]
    assert names == ["engine", "kvservice"]
    shared = set.intersection(*({m["name"] for m in c["volumeMounts"]} for c in spec["containers"]))
    assert shared == {"socket-dir", "dshm"}


def _sidecar(name: str) -> tuple[dict, dict]:
    (dep,) = _docs(DEPLOY / "k8s" / name)
    spec = _pod_spec(dep)
    shared = set.intersection(*({m["name"] for m in c["volumeMounts"]} for c in spec["containers"]))
    assert shared == {"socket-dir", "dshm"}, name
    engine, kv = spec["containers"]
    uds = next(e["value"] for e in kv["env"] if e["name"] == "KVSERVICE_UDS_PATH")
    return engine, {"uds": "unix:" + uds}


def test_engine_sidecars_use_the_adapters_with_the_services_socket() -> None:
    """vLLM: the connector flag names kvservice_vllm and the sidecar's socket; SGLang: the
    kvservice transfer backend, the socket, and the address other nodes reach the service at."""
    engine, kv = _sidecar("vllm-sidecar-example.yaml")
    cmd = engine["command"]
    conf = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert (conf["kv_connector"], conf["kv_connector_module_path"]) == (
        "KVServiceConnector",
        "kvservice_vllm",
    )
    assert conf["kv_connector_extra_config"]["kvservice_address"] == kv["uds"]
    engine, kv = _sidecar("sidecar-example.yaml")
    cmd = engine["command"]
    assert cmd[cmd.index("--disaggregation-transfer-backend") + 1] == "kvservice"
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["SGLANG_KVSERVICE_ADDRESS"] == kv["uds"] and env["SGLANG_KVSERVICE_PEER_ADDRESS"].endswith(
        ":50052"
    )


def test_raw_manifests_speak_kvpeer_on_its_own_port_with_the_peer_token() -> None:
    """No engine TCP port; KVPeer on :50052 with the peer token Secret mounted read-only."""
    for name in ("daemonset.yaml", "sidecar-example.yaml", "vllm-sidecar-example.yaml"):
        docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
        pod = next(d for d in docs if d["kind"] in ("DaemonSet", "Deployment"))["spec"]["template"]["spec"]
        kv = next(c for c in pod["containers"] if c["name"] == "kvservice")
        env = {e["name"]: e.get("value") for e in kv["env"]}
        assert "KVSERVICE_TCP_ADDRESS" not in env and "KVSERVICE_INSECURE" not in env, name
        assert env["KVSERVICE_PEER_TCP_ADDRESS"] == "0.0.0.0:50052", name
        token = env["KVSERVICE_PEER_TOKEN_FILE"]
        mount = next(m for m in kv["volumeMounts"] if m["name"] == "peer-token")
        assert token.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True, name
        vol = next(v for v in pod["volumes"] if v["name"] == "peer-token")
        assert vol["secret"]["secretName"] == "kvservice-peer-token", name


def test_raw_manifests_and_compose_run_the_service_locked_down() -> None:
    """k8s manifests and compose: read-only root, non-root, /tmp writable, caps dropped but IPC_LOCK."""
    for name in ("daemonset.yaml", "sidecar-example.yaml", "vllm-sidecar-example.yaml"):
        docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
        pod = next(d for d in docs if d["kind"] in ("DaemonSet", "Deployment"))["spec"]["template"]["spec"]
        kv = next(c for c in pod["containers"] if c["name"] == "kvservice")
        sc = kv["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True, name
        assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}, name
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        tmp = next(m for m in kv["volumeMounts"] if m["mountPath"] == "/tmp")["name"]
        assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == tmp), name
    svcs = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    for name in (
        "kvservice-prefill",
        "kvservice-decode",
        "engine-prefill",
        "engine-decode",
    ):  # token: root once
        svc = svcs[name]
        assert svc["read_only"] is True and svc["tmpfs"] == ["/tmp"] and svc["user"] == "10001:0", name
        assert svc["cap_drop"] == ["ALL"] and svc["image"] == "kvservice:cpu", name
