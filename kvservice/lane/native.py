"""Deprecated name of :mod:`kvservice.transfer.lane.native`: ``python -m kvservice.lane.native``
still builds the native lane ahead of the first service start, with a warning."""

from __future__ import annotations

import sys
import warnings

from ..transfer.lane.native import LIBCUDA, LaneUnavailable, load, main, nixl_capi_path

__all__ = ["LIBCUDA", "LaneUnavailable", "load", "main", "nixl_capi_path"]

_MOVED = "kvservice.lane.native is deprecated: use kvservice.transfer.lane.native"

if __name__ == "__main__":
    print(_MOVED, file=sys.stderr)
    sys.exit(main())
warnings.warn(_MOVED, DeprecationWarning, stacklevel=2)
