"""Build and load the lane's native module (``csrc/``) with torch's extension builder.

``csrc/lane.h`` declares the one object and says which file holds which route; ``module.cpp``
is the Python binding. The module is C++17 without nvcc: the CUDA driver is opened at run time and
the copy kernel comes as cubins compiled by Triton (``kvservice/kernels/aot.py``), so any host with a
C++ compiler builds it (CI, CPU hosts, the image). Where it goes, first match:

1. ``$KVSERVICE_NATIVE_DIR/<tag>/`` (the ``native_dir`` option) holding a built module: the image
   builds it there at image build time; read-only at run time is fine: a built module is
   imported, never rebuilt, and no compiler is needed;
2. the JIT cache (``kvservice_client.jit_cache.cache_root()/native/<tag>``), built on first use
   (~20 s on a 2-core VM; ``python -m kvservice.transfer.lane.native`` builds it ahead, as setup does),
   unless ``$KVSERVICE_NATIVE_DIR`` is set and writable: then it is built there.

``<tag>`` hashes the source, the Python ABI and torch's version, so a change rebuilds.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["LIBCUDA", "LaneUnavailable", "load", "main", "nixl_capi_path"]

log = logging.getLogger(__name__)
_CSRC = Path(__file__).with_name("csrc")
_NAME = "kvservice_lane"
LIBCUDA = "libcuda.so.1"  # the driver, by soname, for the module's ``init_cuda``
_lock = threading.Lock()
_mod: ModuleType | None = None


class LaneUnavailable(RuntimeError):
    """The native module cannot be built or loaded here (no C++ compiler, say)."""


def _tag() -> str:
    import torch

    h = hashlib.sha256()
    for path in _files():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(f"{sys.implementation.cache_tag}/{torch.__version__}".encode())
    return h.hexdigest()[:16]


def _files() -> list[Path]:
    """Every source and header of the module, in a stable order."""
    return sorted(p for p in _CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def _built(directory: Path) -> Path | None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for cand in (directory / f"{_NAME}{suffix}", directory / f"{_NAME}.so"):
        if cand.is_file():
            return cand
    return None


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, str(path), loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _build_dir() -> Path:
    from kvservice_client.jit_cache import cache_root

    root = cache_root()
    if root is None:
        raise LaneUnavailable("no writable cache directory for the native lane (set KVSERVICE_CACHE_DIR)")
    return root / "native" / _tag()


def _writable(directory: Path) -> bool:
    """Whether this process can create or write ``directory`` (its nearest existing ancestor)."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return os.access(directory, os.W_OK)


def load() -> ModuleType:
    """The native module, built if needed (thread-safe; raises LaneUnavailable)."""
    global _mod
    with _lock:
        if _mod is not None:
            return _mod
        tag = _tag()
        pre = os.environ.get("KVSERVICE_NATIVE_DIR")
        if pre and (path := _built(Path(pre) / tag)) is not None:
            _mod = _import(path)
            return _mod
        # The prebuilt dir is also where `python -m kvservice.transfer.lane.native` builds (the image's build
        # step); one that this uid cannot write (the image at run time, a read-only root) is not.
        out = Path(pre) / tag if pre and _writable(Path(pre)) else _build_dir()
        if (path := _built(out)) is not None:
            _mod = _import(path)
            return _mod
        try:
            from ...native_build import compile_extension

            _mod = compile_extension(
                _NAME,
                [p for p in _files() if p.suffix == ".cpp"],
                out,
                extra_include_paths=[str(_CSRC)],
                extra_ldflags=["-ldl"],
            )
        except Exception as exc:  # no compiler, no ninja, a compile error, no dir: say which
            raise LaneUnavailable(f"building the native lane failed: {type(exc).__name__}: {exc}") from exc
        return _mod


def nixl_capi_path() -> str | None:
    """NIXL's C API library beside the Python bindings in use (the wheels ship it without a
    header: see ``csrc/nixl_capi.h``), or None when NIXL is not installed."""
    try:
        from nixl import _bindings  # type: ignore[import-untyped]
    except ImportError:
        return None
    pkg = Path(_bindings.__file__).parent
    for cand in (pkg.parent / f".{pkg.name}.mesonpy.libs" / "libnixl_capi.so", pkg / "libnixl_capi.so"):
        if cand.is_file():
            return str(cand)
    return None


def main() -> int:
    """``python -m kvservice.transfer.lane.native``: build ahead of the first service start."""
    logging.basicConfig(level=logging.INFO)
    try:
        print(f"native lane: {load().__file__}")
    except LaneUnavailable as exc:
        print(f"native lane unavailable: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
