"""Where JIT caches (numba, Triton) go: never into the installed package.

numba's ``cache=True`` writes beside the module's source; in a container with a read-only root
filesystem (or site-packages owned by another user) that raises at import time ("no locator
available"). Triton writes under ``~/.triton``, which an arbitrary uid may not have. So both get
a directory chosen once, in this order:

1. ``NUMBA_CACHE_DIR`` / ``TRITON_CACHE_DIR`` when the user set them (left as they are);
2. ``$KVSERVICE_CACHE_DIR/{numba,triton}`` (the image sets it; manifests mount an emptyDir);
3. ``$XDG_CACHE_HOME/kvservice`` or ``~/.cache/kvservice``, if writable;
4. ``<tmp>/kvservice-<uid>``.

When none of them is writable, numba compiles without a cache (slower start, same results).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["cache_root", "configure", "njit"]

_done: dict[str, str] = {}


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def cache_root() -> Path | None:
    """The first writable directory of the list above (created), or None."""
    candidates = []
    if os.environ.get("KVSERVICE_CACHE_DIR"):
        candidates.append(Path(os.environ["KVSERVICE_CACHE_DIR"]))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    candidates += [Path(xdg) / "kvservice", Path(tempfile.gettempdir()) / f"kvservice-{os.getuid()}"]
    return next((c for c in candidates if _writable(c)), None)


def configure() -> dict[str, str]:
    """Point numba and Triton at the cache directory (once); returns {tool: directory}."""
    if _done:
        return _done
    root = cache_root()
    for tool, var in (("numba", "NUMBA_CACHE_DIR"), ("triton", "TRITON_CACHE_DIR")):
        if os.environ.get(var):
            _done[tool] = os.environ[var]
        elif root is not None:
            os.environ[var] = _done[tool] = str(root / tool)
    try:  # numba may have read its config already (imported before us)
        import numba.core.config as numba_config

        if _done.get("numba"):
            numba_config.CACHE_DIR = _done["numba"]  # type: ignore[attr-defined]
    except ImportError:
        pass
    return _done


def njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=..., **options)`` with the cache in :func:`configure`'s directory."""
    import numba

    return numba.njit(cache=bool(configure().get("numba")), **options)
