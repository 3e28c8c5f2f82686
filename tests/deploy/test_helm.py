"""The Helm chart: `helm lint --strict` is clean and both modes render the expected objects.

Skips when no `helm` binary is found on PATH or in ~/go/bin (CI installs it with
`go install helm.sh/helm/v3/cmd/helm@latest`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

CHART = Path(__file__).parents[2] / "deploy" / "helm" / "kvservice"
GO_HELM = Path(os.environ.get("GOPATH", Path.home() / "go")) / "bin" / "helm"
HELM = shutil.which("helm") or (str(GO_HELM) if GO_HELM.exists() else None)
SOCKET = "unix:/run/kvservice/kvservice.sock"

pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm not found (go install helm.sh/helm/v3/cmd/helm@latest)"
)


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _render(*sets: str) -> dict[str, dict[str, Any]]:
    args = [a for s in sets for a in ("--set", s)]
    docs = [d for d in yaml.safe_load_all(_helm("template", "t", str(CHART), *args).stdout) if d]
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


@pytest.mark.parametrize("mode", ["daemonset", "sidecar"])
def test_lint_is_clean(mode: str) -> None:
    """`helm lint --strict` reports no warning or error in either mode."""
    out = _helm("lint", "--strict", str(CHART), "--set", f"mode={mode}").stdout
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


def test_daemonset_mode_renders_a_node_service() -> None:
    """DaemonSet: hostIPC, socket on a hostPath, health probes on the socket, scrape annotations."""
    objs = _render("staging.hostMb=333", "staging.vramMb=444")
    assert set(objs) == {"ServiceAccount", "ConfigMap", "Service", "DaemonSet", "Secret"}
    pod = objs["DaemonSet"]["spec"]["template"]
    spec = pod["spec"]
    assert spec["hostIPC"] is True and spec["runtimeClassName"] == "nvidia"
    assert {
        "name": "socket-dir",
        "hostPath": {"path": "/run/kvservice", "type": "DirectoryOrCreate"},
    } in spec["volumes"]
    kv = _container(spec, "kvservice")
    env = _env(kv)
    assert env["KVSERVICE_UDS_PATH"] == "/run/kvservice/kvservice.sock"
    assert env["KVSERVICE_HOST_STAGING_MB"] == "333" and env["KVSERVICE_VRAM_STAGING_MB"] == "444"
    assert env["KVSERVICE_METRICS_PORT"] == "9400" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert kv[probe]["exec"]["command"] == ["kvservice", "health", "--address", SOCKET]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9400"
    assert "kvservice.json" in objs["ConfigMap"]["data"]


def test_sidecar_mode_renders_engine_and_service_in_one_pod() -> None:
    """Sidecar: a Deployment whose engine and kvservice share an emptyDir socket dir."""
    objs = _render(
        "mode=sidecar",
        "gpu.resourceName=nvidia.com/gpu",
        "gpu.count=1",
        "metrics.serviceMonitor.enabled=true",
    )
    assert set(objs) == {"ServiceAccount", "ConfigMap", "Service", "Deployment", "ServiceMonitor", "Secret"}
    spec = objs["Deployment"]["spec"]["template"]["spec"]
    assert "hostIPC" not in spec
    engine, kv = _container(spec, "engine"), _container(spec, "kvservice")
    assert _env(engine)["KVSERVICE_ADDRESS"] == SOCKET
    assert kv["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["name"] for m in engine["volumeMounts"]} & {m["name"] for m in kv["volumeMounts"]}
    assert mounts == {"socket-dir", "dshm"}
    assert {"name": "socket-dir", "emptyDir": {}} in spec["volumes"]


def test_ports_and_socket_path_are_configurable() -> None:
    """Changing ports and the socket directory changes env, probes, container ports and annotations."""
    objs = _render(
        "ports.grpc=6000",
        "ports.peer=6001",
        "ports.metrics=7000",
        "uds.dir=/var/run/kv",
        "security.insecure=true",
    )
    pod = objs["DaemonSet"]["spec"]["template"]
    kv = _container(pod["spec"], "kvservice")
    assert {p["containerPort"] for p in kv["ports"]} == {6000, 6001, 7000}
    assert _env(kv)["KVSERVICE_TCP_ADDRESS"] == "0.0.0.0:6000"
    assert _env(kv)["KVSERVICE_PEER_TCP_ADDRESS"] == "0.0.0.0:6001"
    assert kv["livenessProbe"]["exec"]["command"][-1] == "unix:/var/run/kv/kvservice.sock"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "7000"


@pytest.mark.parametrize(("mode", "kind"), [("daemonset", "DaemonSet"), ("sidecar", "Deployment")])
def test_the_service_runs_locked_down_with_only_tmp_and_the_socket_writable(mode: str, kind: str) -> None:
    """Read-only root, non-root, seccomp RuntimeDefault, all capabilities dropped but IPC_LOCK; /tmp
    is an emptyDir and the JIT cache lives under it (the settings image-smoke.sh proves)."""
    pod = _render(f"mode={mode}")[kind]["spec"]["template"]["spec"]
    kv = _container(pod, "kvservice")
    sc = kv["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"]: m["name"] for m in kv["volumeMounts"]}
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == mounts["/tmp"])
    assert _env(kv)["KVSERVICE_CACHE_DIR"].startswith("/tmp/")


def test_tcp_is_authenticated_or_closed() -> None:
    """Default: no engine TCP port at all; KVPeer on its own port with a generated peer token
    Secret (kept across upgrades), mounted read-only. Engine TCP opens only with a token or TLS
    Secret; peer mutual TLS mounts a cert-manager style Secret."""
    objs = _render()
    kv = _container(objs["DaemonSet"]["spec"]["template"]["spec"], "kvservice")
    env = _env(kv)
    assert "KVSERVICE_TCP_ADDRESS" not in env and "KVSERVICE_INSECURE" not in env
    assert env["KVSERVICE_PEER_TCP_ADDRESS"] == "0.0.0.0:50052"
    assert env["KVSERVICE_ADVERTISE_ADDRESS"] == "$(POD_IP):50052"
    assert env["KVSERVICE_PEER_TOKEN_FILE"] == "/var/run/kvservice-secrets/peer-token/peer-token"
    secret = objs["Secret"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(secret["data"]["peer-token"]) >= 48
    mount = next(m for m in kv["volumeMounts"] if m["name"] == "peer-token")
    assert mount["readOnly"] is True and mount["mountPath"] == "/var/run/kvservice-secrets/peer-token"
    assert {p["name"] for p in objs["Service"]["spec"]["ports"]} == {"peer", "metrics"}

    objs = _render(
        "security.engineToken.secretName=etok",
        "security.engineTLS.secretName=etls",
        "security.peerTLS.secretName=ptls",
        "security.peerToken.create=false",
    )
    assert "Secret" not in objs
    spec = objs["DaemonSet"]["spec"]["template"]["spec"]
    env = _env(_container(spec, "kvservice"))
    assert env["KVSERVICE_TCP_ADDRESS"] == "0.0.0.0:50051"
    assert env["KVSERVICE_TOKEN_FILE"].endswith("engine-token/token")
    assert env["KVSERVICE_TLS_CLIENT_CA"].endswith("engine-tls/ca.crt")
    assert (
        env["KVSERVICE_PEER_TLS_CERT"].endswith("peer-tls/tls.crt") and "KVSERVICE_PEER_TOKEN_FILE" not in env
    )
    volumes = {v["name"]: v.get("secret", {}).get("secretName") for v in spec["volumes"]}
    assert (volumes["engine-token"], volumes["engine-tls"], volumes["peer-tls"]) == ("etok", "etls", "ptls")
