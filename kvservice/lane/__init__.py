"""Deprecated name of :mod:`kvservice.transfer.lane` (moved with the transfer engine it calls,
decision 0030); importing it warns and gives the same objects. Removed in a later release."""

from __future__ import annotations

import warnings

from ..transfer.lane import LaneBook, NoLane, RunningLane, start

__all__ = ["LaneBook", "NoLane", "RunningLane", "start"]

warnings.warn("kvservice.lane is deprecated: use kvservice.transfer.lane", DeprecationWarning, stacklevel=2)
