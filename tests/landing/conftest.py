"""The end-to-end landing tests here run on the transfer tests' fixtures and helpers (loopback
service pairs, shm pools, clients): ``tests/transfer`` goes on the path for the helpers, and its
conftest's fixtures are loaded under a name of their own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TRANSFER = Path(__file__).resolve().parents[1] / "transfer"
sys.path.insert(0, str(TRANSFER))

_spec = importlib.util.spec_from_file_location("transfer_fixtures", TRANSFER / "conftest.py")
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

make_client, make_pool, pair = _fixtures.make_client, _fixtures.make_pool, _fixtures.pair

__all__ = ["make_client", "make_pool", "pair"]
