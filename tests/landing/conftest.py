"""The end-to-end landing tests here run on the transfer tests' fixtures and helpers (loopback
service pairs, shm pools, clients): ``tests/transfer`` is put on the path for them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transfer"))

from tests.transfer.conftest import make_client, make_pool, pair  # noqa: E402

__all__ = ["make_client", "make_pool", "pair"]
