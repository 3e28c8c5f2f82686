"""Layer-wise transfers: a request's KV sent as one transfer per model layer (pipeline-parallel
stages hold different layers; a stage sends or receives only its own), as both engine adapters
(kvservice_vllm, kvservice_sglang) name and settle them::

    layer_tid("req-7", 12)  -> "req-7#L12"    (the model's layer number, alike on every stage)
    all_done(bg, futures, tids)               one terminal status for them all
    abort_all(bg, tids, reason)               every layer's transfer aborted, errors logged
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Sequence

from ._background import BackgroundClient
from ._errors import NotFound
from ._types import TransferStatus

__all__ = ["abort_all", "all_done", "layer_tid"]

log = logging.getLogger(__name__)


def layer_tid(transfer_id: str, layer: int) -> str:
    """The transfer id of ``layer``'s part of the layer-wise transfer ``transfer_id``."""
    return f"{transfer_id}#L{int(layer)}"


def all_done(
    bg: BackgroundClient, futures: Sequence[concurrent.futures.Future[TransferStatus]], tids: Sequence[str]
) -> concurrent.futures.Future[TransferStatus]:
    """One terminal status for a request's layer transfers ``tids`` (``futures``: each one's, as
    ``BackgroundClient.transfer`` gives them): the last DONE when all are DONE, else the first that
    is not (or the client error of the first that failed to start), once the others' waits were
    cancelled and every transfer was aborted and the aborts settled."""

    async def wait() -> TransferStatus:
        pending = {asyncio.wrap_future(f) for f in futures}
        last: TransferStatus | None = None
        while pending:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for f in finished:
                try:
                    st = f.result()
                except BaseException:  # a client error ends the whole request the same way
                    await stop(pending, "a layer transfer failed in the client")
                    raise
                if st.state != "DONE":
                    await stop(pending, f"layer transfer {st.transfer_id} ended {st.state}")
                    return st
                last = st
        if last is None:
            raise ValueError("all_done: no layer transfer given")
        return last

    async def stop(pending: set[asyncio.Future[TransferStatus]], reason: str) -> None:
        for f in pending:
            f.cancel()
        await abort_all(bg, tids, reason)

    return bg.submit(wait())


async def abort_all(bg: BackgroundClient, tids: Sequence[str], reason: str) -> None:
    """Abort each transfer; one already over (NOT_FOUND) or failing to abort is logged, not raised."""

    async def one(tid: str) -> None:
        try:
            await bg.kv.abort(tid, reason)
        except NotFound:
            pass
        except Exception as exc:
            log.warning("kvservice: abort of %s failed: %s", tid, exc)

    with contextlib.suppress(Exception):
        await asyncio.gather(*(one(t) for t in tids))
