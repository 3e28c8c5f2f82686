"""grpcurl, a gRPC client nobody here wrote: its path, or the calling test skips."""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["grpcurl"]


def grpcurl() -> str:
    """The grpcurl binary (PATH or ~/go/bin; scripts/test.sh installs it when Go is present)."""
    path = shutil.which("grpcurl") or os.path.expanduser("~/go/bin/grpcurl")
    if not os.path.exists(path):
        pytest.skip("grpcurl not installed (scripts/test.sh installs it with Go)")
    return path
