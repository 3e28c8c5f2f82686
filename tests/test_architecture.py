"""The service's import boundaries (docs/decisions/0015, 0030), read from the source:

* no import cycle between the service's packages (``kvservice/<package>/`` and the top-level
  modules): each import counts, ``TYPE_CHECKING`` and function-level ones too, so the packages
  stack in layers a reader can take one at a time;

* the service imports the SDK's public modules only (``kvservice_client``, ``.contract``,
  ``.proto``, ``.lane_wire``, ...), never a private one (``kvservice_client._*``);
* protobuf appears only where the service meets the wire: ``server/``, the CLI (a client of the
  service), the peer boundary of ``transfer/`` (the peer channel, codec, receiver port, serving
  side and the peer connections) and the operator view's health probe of peers; domain code
  (plans, routes, receivers, records, the lane, the index) works on the domain's values;
* tests import no other test module: what they share is in ``tests/support`` (and fixtures in a
  conftest), so a test file can move or go without breaking another.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE = ROOT / "kvservice"
TESTS = ROOT / "tests"
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
    counts as X.Y as well, so ``from kvservice_client import _proto`` is caught; a relative
    import keeps its dots (``.test_cuda_ipc``)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out += (
                [(node.lineno, base)] if node.module else [(node.lineno, base + a.name) for a in node.names]
            )
    return out


def _private(module: str) -> bool:
    """``module`` is (in) one of the SDK's private modules."""
    return module.startswith("kvservice_client.") and any(s.startswith("_") for s in module.split(".")[1:])


def _test_module_names(tests: Path) -> set[str]:
    """Names a file of the tests tree could be imported by through a ``sys.path`` entry of the
    tree (pytest puts each test directory on it): its modules' and packages' names."""
    names = {p.stem for p in tests.rglob("*.py")} | {d.name for d in tests.rglob("*") if d.is_dir()}
    return names - {"conftest", "__init__", "tests"}


def _imports_another_test_module(module: str, local: set[str]) -> bool:
    """``module`` is a module of the tests tree other than tests.support and a conftest."""
    parts = module.lstrip(".").split(".")
    if parts[-1] == "conftest" or parts[0] == "conftest":
        return False
    if module.startswith("."):  # relative: inside a test package (tests/gpu, tests/buffers)
        return True
    if parts[0] == "tests":
        return len(parts) > 1 and parts[1] != "support"
    return parts[0] in local


def _foreign_test_imports(tests: Path) -> list[str]:
    local = _test_module_names(tests)
    return [
        f"{p.relative_to(tests.parent)}:{line} {mod}"
        for p in sorted(tests.rglob("*.py"))
        for line, mod in _imports(p)
        if _imports_another_test_module(mod, local)
    ]


def _package_edges(service: Path) -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the imports behind it (``file:line module``), across
    units only. A unit is a package under ``service`` or a top-level module (``transfer/lane/
    book.py`` is in ``transfer``); relative imports resolve against the importing module's package."""
    edges: dict[tuple[str, str], list[str]] = {}
    for p in sorted(service.rglob("*.py")):
        rel = p.relative_to(service).with_suffix("").parts
        package = rel[:-1]  # the package a module's relative imports start from
        for line, mod in _imports(p):
            if mod.startswith("."):
                dots = len(mod) - len(mod.lstrip("."))
                base = package[: len(package) - (dots - 1)] if dots - 1 <= len(package) else None
                if base is None:
                    continue
                parts = (*base, *[x for x in mod.lstrip(".").split(".") if x])
            elif mod.split(".")[0] == service.name:
                parts = tuple(mod.split(".")[1:])
            else:
                continue
            if not parts or parts[0] == "__init__":
                continue
            src, dst = rel[0], parts[0]
            if src == dst or "__init__" in (src, dst):
                continue
            if (service / dst).is_dir() or (service / f"{dst}.py").exists():
                edges.setdefault((src, dst), []).append(f"{p.relative_to(service.parent)}:{line} {mod}")
    return edges


def _cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one unit (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _cycle_report(service: Path) -> str:
    edges = _package_edges(service)
    lines = []
    for group in _cycles(edges):
        lines.append("cycle: " + " <-> ".join(group))
        for (a, b), where in sorted(edges.items()):
            if a in group and b in group:
                lines += [f"  {a} -> {b}: {w}" for w in where]
    return "\n".join(lines)


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


def test_no_import_cycle_between_the_services_packages() -> None:
    assert len(_package_edges(SERVICE)) > 20, "the service's imports were not found"
    report = _cycle_report(SERVICE)
    assert not report, "import cycles between the service's packages:\n" + report


@pytest.mark.parametrize(
    "files, cycle",
    [
        (
            {"a/__init__.py": "", "a/m.py": "from ..b import x\n", "b/__init__.py": "from ..a.m import y\n"},
            True,
        ),
        (
            {
                "a/__init__.py": "",
                "a/m.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import z\n",
                "b.py": "def f():\n    from .a import m\n",
                "c/__init__.py": "",
                "c/deep/n.py": "from ... import b\n",
            },
            True,
        ),
        (
            {"a/__init__.py": "", "a/m.py": "from svc.b import x\n", "b.py": "from . import c\n", "c.py": ""},
            False,
        ),
        (
            {
                "a/__init__.py": "from .m import y\n",
                "a/m.py": "from .. import a\nfrom ..b import x\n",
                "b.py": "",
            },
            False,
        ),
    ],
)
def test_the_cycle_check_sees_a_cycle(tmp_path: Path, files: dict[str, str], cycle: bool) -> None:
    service = tmp_path / "svc"
    for name, text in files.items():
        (service / name).parent.mkdir(parents=True, exist_ok=True)
        (service / name).write_text(text)
    assert bool(_cycle_report(service)) is cycle


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


def test_tests_import_no_other_test_module() -> None:
    bad = _foreign_test_imports(TESTS)
    assert not bad, "test modules importing other test modules (share through tests/support):\n" + "\n".join(
        bad
    )


@pytest.mark.parametrize(
    "source, caught",
    [
        ("from e2e_helpers import one\n", True),  # a helper beside the tests, through sys.path
        ("from test_other import LAYOUT\n", True),
        ("def f():\n    from tests.transfer.test_other import link\n", True),
        ("from .test_other import Engine\n", True),
        ("from . import test_other\n", True),
        ("from tests.support.poll import eventually\n", False),
        ("from tests.support import sglang_stub\n", False),
        ("from .conftest import factory\n", False),
        ("import numpy as np\nfrom kvservice_client import Layout\n", False),
    ],
)
def test_the_tests_check_sees_an_import(tmp_path: Path, source: str, caught: bool) -> None:
    tests = tmp_path / "tests"
    (tests / "transfer").mkdir(parents=True)
    (tests / "support").mkdir()
    for name in ("transfer/e2e_helpers.py", "transfer/test_other.py", "support/poll.py", "conftest.py"):
        (tests / name).write_text("")
    (tests / "transfer" / "test_m.py").write_text(source)
    assert any("test_m.py" in line for line in _foreign_test_imports(tests)) is caught
