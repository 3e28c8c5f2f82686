"""Building a native module with torch's extension builder (the lane, the fault guard): C++17,
no nvcc, any host with a C++ compiler and ninja (pip's, beside the interpreter)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["compile_extension"]


def compile_extension(name: str, sources: list[Path], out: Path, **kw: Any) -> Any:
    """Build ``sources`` into ``out`` as ``name`` (``kw``: the builder's own, e.g.
    ``is_python_module=False``); what ``torch.utils.cpp_extension.load`` returns. Raises what
    the builder raises (no compiler, a compile error)."""
    from torch.utils import cpp_extension

    bindir = os.path.dirname(sys.executable)  # pip's ninja, in an unactivated venv
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), bindir])
    out.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=name,
        sources=[str(p) for p in sources],
        build_directory=str(out),
        extra_cflags=["-O2", "-std=c++17"],
        verbose=False,
        **kw,
    )
