"""Deprecated name of :mod:`kvservice.transfer.landing` (moved with the transfer engine it calls,
decision 0030); importing it warns and gives the same objects. Removed in a later release."""

from __future__ import annotations

import warnings

from ..transfer.landing import Entry, LandedMatch, Landing, LandingBook, LandingPool, LandingStats, claim

__all__ = ["Entry", "LandedMatch", "Landing", "LandingBook", "LandingPool", "LandingStats", "claim"]

warnings.warn(
    "kvservice.landing is deprecated: use kvservice.transfer.landing", DeprecationWarning, stacklevel=2
)
