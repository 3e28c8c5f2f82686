"""Delta transfers between services: the engine (receiver and sender halves, peers, deadlines,
aborts), chunk planning, the data path (direct and packed) and the transport behind an interface
(``transport``; NIXL in ``nixl_transport``, the only module importing nixl; ``loopback`` double).
"""

from .engine import TransferEngine, make_transport
from .records import Record, TransferTable
from .transport import Transport

__all__ = ["Record", "TransferEngine", "TransferTable", "Transport", "make_transport"]
