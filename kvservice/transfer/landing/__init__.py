"""Landing buffers: transfers that do not wait for the decode engine's allocation (docs/decisions/0012).

A receiver declares a transfer without destination pages (``ExpectDelta.landing``); its pages land
in a service-owned landing pool on this node and the transfer reports LANDED, which frees the
senders' pages. Aux rows the declaration counts (``Landing.aux``) land in landing rows beside them.
When the engine has allocated it claims the landed pages and rows (``Claim``): one same-device
fused copy into its pool and a row copy into the rows it names, then DONE. Modules:

* ``declare``  validation and the landing view (the engine's layout, and aux rows, over landing memory)
* ``_arena``   one allocation per memory location, carved by the staging range allocator
* ``pool``     the arenas under the ``landing_pool_mb`` budget (aux rows in the host one)
* ``book``     landing entries: LANDED, TTL expiry, eviction, freeing, router matches
* ``claim``    the Claim: checks, wait for LANDED, the copy, DONE, publish
"""

from __future__ import annotations

from .book import Entry, LandedMatch, LandingBook
from .claim import claim
from .pool import Landing, LandingPool, LandingStats

__all__ = ["Entry", "LandedMatch", "Landing", "LandingBook", "LandingPool", "LandingStats", "claim"]
