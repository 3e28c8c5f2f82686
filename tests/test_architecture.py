"""The service's import boundaries (issue 28 item 6, design-notes §17), read from the source:

* the service imports the SDK's public modules only (``kvservice_client``, ``.contract``,
  ``.proto``, ``.lane_wire``, ...), never a private one (``kvservice_client._*``);
* protobuf appears only where the service meets the wire: ``server/``, the CLI (a client of the
  service), the peer boundary of ``transfer/`` (the peer channel, codec, receiver port, serving
  side and the peer connections) and the operator view's health probe of peers; domain code
  (plans, routes, receivers, records, the lane, the index) works on the domain's values.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE = ROOT / "kvservice"
PROTO_DIRS = ("server/", "cli/")
PROTO_ALLOWED = {
    "ops/snapshot.py",
    "transfer/peer_channel.py",
    "transfer/peer_codec.py",
    "transfer/peer_receiver.py",
    "transfer/peer_serving.py",
    "transfer/peers.py",
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, function-level ones too; ``from X import Y``
    counts as X.Y as well, so ``from kvservice_client import _proto`` is caught."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _private(module: str) -> bool:
    """``module`` is (in) one of the SDK's private modules."""
    return module.startswith("kvservice_client.") and any(s.startswith("_") for s in module.split(".")[1:])


def _service_files() -> list[Path]:
    files = sorted(SERVICE.rglob("*.py"))
    assert len(files) > 100, "the service's sources were not found"
    return files


def test_the_service_imports_no_private_module_of_the_sdk() -> None:
    bad = [
        f"{p.relative_to(ROOT)}:{line} {mod}"
        for p in _service_files()
        for line, mod in _imports(p)
        if _private(mod)
    ]
    assert not bad, "private SDK modules imported by the service:\n" + "\n".join(bad)


def test_protobuf_only_at_the_wire() -> None:
    bad = []
    for p in _service_files():
        rel = p.relative_to(SERVICE).as_posix()
        if rel.startswith(PROTO_DIRS) or rel in PROTO_ALLOWED:
            continue
        bad += [
            f"{rel}:{line} {mod}"
            for line, mod in _imports(p)
            if mod.startswith(("kvservice_client.proto", "google.protobuf")) or mod.endswith("_pb2")
        ]
    assert not bad, "protobuf in domain code:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source, caught",
    [
        ("from kvservice_client._client import channel_options\n", True),
        ("def f():\n    import kvservice_client._tokens\n", True),
        ("from kvservice_client import _proto\n", True),
        ("from kvservice_client.contract import PLAIN\n", False),
        ("from kvservice_client import Layout\n", False),
    ],
)
def test_the_check_sees_an_import(tmp_path: Path, source: str, caught: bool) -> None:
    p = tmp_path / "m.py"
    p.write_text(source)
    assert any(_private(m) for _, m in _imports(p)) is caught
