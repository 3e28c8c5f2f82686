"""The receiver as a route sees it (data path v3 §6): plans, staging, aux rows, commits, aborts.

    SendDelta chunk ─▶ Dispatch.move (dispatch.py: picks the route)
                        │
                        ├─ routes/same_node.py  one fused copy into the receiver's mapped pools
                        ├─ routes/packed.py     pack ─▶ staging ─▶ WRITE (or none) ─▶ unpack there
                        └─ routes/direct.py     page WRITEs straight into the receiver's pages
                        │
                        ▼  every route talks to one ReceiverPort, never to "is it us?"
          LocalReceiver (local_receiver.py)   this service: Inbound directly, no protobuf
          PeerReceiver  (peer_receiver.py)    another service: its channel / KVPeer calls
                        │
                        ▼
          Inbound.accept (inbound.py): unpack a packed batch, account, DONE + publish after the last

The values it takes and returns are in values.py; protobuf stays at the peer boundary (peer_codec.py).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import numpy as np

from .sender import Chunk, Outgoing
from .values import Commit, Plan, Reserved, Target

__all__ = ["ReceiverPort"]


class ReceiverPort(Protocol):
    """One receiving service, as the routes of one sending service see it.

    Every method runs on the event loop and raises the kvservice error tree (NotFound: no such
    declaration; Aborted: the receiver ended it; DeadlineExceeded; Unavailable).
    """

    verifies_copies: bool  # a fused copy's commit carries a checksum (the receiver is another service)

    async def targets(self, out: Outgoing) -> list[Target]:
        """The receiver ranks ``out`` writes to, waiting (within its deadline) for their
        declarations; binds this sender rank to each (one ticket per rank)."""
        ...

    def writing(self, out: Outgoing, target: Target) -> AbstractAsyncContextManager[None]:
        """Held while a route writes into the receiver's mapped pools: refuses once the receiver
        ended, and an abort of the receiver returns only after the block left."""
        ...

    async def batch_pages(self, out: Outgoing, target: Target, per_page: int, pages: int) -> int:
        """How many pages of ``per_page`` packed bytes one staging batch may carry."""
        ...

    async def reserve(self, out: Outgoing, target: Target, nbytes: int) -> Reserved:
        """Room for ``nbytes`` of packed pages in the receiver's staging (a credit when it can)."""
        ...

    async def unreserve(self, out: Outgoing, target: Target, slot: Reserved) -> None:
        """Give back room no commit will use (a batch that failed before its commit)."""
        ...

    async def write(
        self, out: Outgoing, local: np.ndarray, remote: np.ndarray, local_kind: str, remote_kind: str
    ) -> None:
        """WRITE descriptor rows ``[addr, bytes, device]`` of ours into the receiver's memory;
        returns once they landed (on ``out``'s stop or deadline: settled, then raises)."""
        ...

    async def remote_pages(self, plan: Plan) -> Any:
        """The transport's prepped descriptor list of the plan's pages (DIRECT writes)."""
        ...

    async def write_aux(self, out: Outgoing, target: Target, chunk: Chunk) -> tuple[int, int]:
        """Write the chunk's aux rows into the rows the receiver declared; (bytes, descriptors)."""
        ...

    async def commit(
        self, out: Outgoing, target: Target, seq: int, commit: Commit, slot: Reserved | None = None
    ) -> None:
        """Tell the receiver rank the commit's positions landed (a PACKED batch: in ``slot``);
        returns once it accepted them (the batch is unpacked by then; a credit is back).
        Raises what the receiver refused."""
        ...

    async def tell_abort(self, out: Outgoing, code: str, reason: str) -> None:
        """Best effort: this sender stopped (its writes are settled)."""
        ...
