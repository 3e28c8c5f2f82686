"""A room as one transfer per layer (``layers``): what a decode stage declares and a prefill stage
sends, when either instance runs pipeline parallelism::

    decode stage   send_metadata ─▶ ExpectDelta(sgl-<room>#L<l>, layer l's own buffer set, prefix,
                   kv_indices) for each layer l it holds; its first layer's also takes its aux rows
                   └─ PUT /room/<room> {peer, decode_prefix_len, layers}
    prefill stage  GET /room/<room>?layers=<its layers>: found once the decode stages that posted
                   hold them all
                   send(pages) per chunk ─▶ SendDelta(sgl-<room>#L<l>, chunk_offset as for a whole
                   room) for each layer l it holds, to the kvservice of the decode stage holding l;
                   the last chunk carries the aux rows on each decode stage's first layer
    both           Success once every layer transfer of the stage is DONE (``layers.all_done``)

Each side of a layer transfer is one rank of one stage, so mixed TP works per layer as for a whole
room (the service slices heads, or serves an MLA layer from one replica).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from kvservice_client import TransferStatus

from .layers import all_done, aux_layer, layer_tid

if TYPE_CHECKING:
    from .manager import KVServiceManager

__all__ = ["LayerRoute", "LayerSend", "declare_layers", "routes"]


class LayerRoute(NamedTuple):
    """Where one layer of a prefill stage goes."""

    peer: str  # the kvservice of the decode stage holding the layer
    aux: bool  # it is that stage's first layer: its transfer carries the stage's aux rows


def routes(entry: Mapping[str, Any], layers: Sequence[int]) -> dict[int, LayerRoute]:
    """The route of each of ``layers`` through the decode stages of a room entry (``stages``);
    ``ValueError`` names the layers no stage holds."""
    held: dict[int, LayerRoute] = {}
    for stage in entry.get("stages", ()):
        first = aux_layer(stage["layers"])
        for layer in stage["layers"]:
            held[int(layer)] = LayerRoute(str(stage["peer"]), int(layer) == first)
    missing = [i for i in layers if i not in held]
    if missing:
        raise ValueError(f"no decode stage of the room holds layers {missing}")
    return {i: held[i] for i in layers}


class LayerSend:
    """A prefill stage's side of a per-layer room: each of its layers a chunked transfer, its
    chunks sent in order; ``outcome`` ends with all of them (early only when one fails)."""

    def __init__(self, mgr: KVServiceManager, transfer_id: str, entry: Mapping[str, Any]) -> None:
        self.mgr = mgr
        self.routes = routes(entry, mgr.layer_ids)
        self.tids = {i: layer_tid(transfer_id, i) for i in self.routes}
        self.chunks = {i: mgr.bg.chunked(t, mgr.deadline_ms) for i, t in self.tids.items()}
        self.outcome: concurrent.futures.Future[TransferStatus] = all_done(
            mgr.bg, [c.done for c in self.chunks.values()], list(self.tids.values())
        )
        self._first = True

    def send(self, pages: np.ndarray, offset: int, last: bool, aux: Mapping[str, list[int]]) -> None:
        """One chunk (``pages`` at sequence page ``offset``) of every layer; ``aux`` on the last."""
        mgr, first = self.mgr, self._first
        self._first = False
        for layer, route in self.routes.items():
            tid, rows = self.tids[layer], dict(aux) if last and route.aux else {}

            def start(
                kv: Any, layer: int = layer, tid: str = tid, rows: Any = rows, peer: str = route.peer
            ) -> Any:
                return mgr.on_session(
                    lambda bs: kv.send_delta(
                        tid, bs, src_page_indices=pages, chunk_offset=offset, last_chunk=last,
                        peer_address=peer, aux=rows, deadline_ms=mgr.deadline_ms,
                    ),
                    first=first,
                    layer=layer,
                )  # fmt: skip

            self.chunks[layer].send(start, last)


def declare_layers(
    mgr: KVServiceManager,
    transfer_id: str,
    pages: np.ndarray,
    prefix_pages: int,
    aux: Mapping[str, list[int]],
    sender: str,
) -> concurrent.futures.Future[TransferStatus]:
    """ExpectDelta of each layer this decode stage holds (the same prefix and pages), its first
    layer's with ``aux``; the future ends with all of them."""
    first = aux_layer(mgr.layer_ids)
    tids = [layer_tid(transfer_id, i) for i in mgr.layer_ids]

    def start(kv: Any, layer: int, tid: str) -> Any:
        return mgr.on_session(
            lambda bs: kv.expect_delta(
                tid, bs, prefix_pages=prefix_pages, dst_page_indices=pages,
                aux=dict(aux) if layer == first else {}, deadline_ms=mgr.deadline_ms, sender_address=sender,
            ),
            layer=layer,
        )  # fmt: skip

    futs = [
        mgr.bg.transfer(tid, lambda kv, i=i, t=tid: start(kv, i, t), mgr.deadline_ms)  # type: ignore[misc]
        for i, tid in zip(mgr.layer_ids, tids, strict=True)
    ]
    return all_done(mgr.bg, futs, tids)
