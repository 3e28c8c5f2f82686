"""Layer-wise streaming: each layer's pages leave as soon as the prefill has computed that layer.

The service's chunk is a run of a transfer's *pages across every layer* (decision 0023: a chunk
names ``chunk_offset`` and its pages; the receiver's plan skips a leading ``prefix_pages``). A
layer's pages are not such a run, so a layer-wise transfer is **one transfer per layer**, each on
a buffer set of that one layer (registered beside the whole-cache set, over the same memory)::

    request R, transfer id T, L layers, prompt pages 0..n-1, decode's prefix hit p pages

    layer l     buffer set        transfer      chunks (one per engine step that completed pages)
    0           bs#L0 (1 layer)   T#L0          [0, a) [a, b) ... [.., n) last
    ...
    L-1         bs#L{L-1}         T#L{L-1}      same runs
                every T#Ll: prefix_pages = p, dst = the decode's blocks p..n-1 (same for each l)

    step s, layer l computed (save_kv_layer)  ─▶ chunk of T#Ll: pages this step completed
    the step that completes the prompt         ─▶ its chunk is ``last`` (the partial page with it)

So each chunk is a contiguous run of its transfer in the receiver's order, the prefix skip works
per layer as for a whole transfer, and mixed TP slices heads per layer as before. The request's
outcome is every layer transfer's: DONE when all are; at the first that is not, the others are
aborted and the request fails only once every abort settled (no write after).

Pipeline parallelism falls out of it: a transfer's layer ``l`` is vLLM's layer ``l`` of the
model (the number in its layer name), so a PP stage sends, or declares, the transfers of the
layers it holds, and each layer meets the stage that holds it on the other side, whatever the two
PP sizes (PP-m prefill -> PP-n decode, TP x PP: each stage's TP ranks slice heads as before)::

    prefill PP 2: stage 0 layers 0-7 ─▶ T#L0..T#L7    decode PP 1: one stage declares T#L0..T#L15
                  stage 1 layers 8-15 ─▶ T#L8..T#L15

What the service lacks for one transfer per request: a chunk naming a layer range
(``SendDelta.layer_begin/layer_end``: a 2-D chunk, pages x layers) and a stream that ends when
every (page run, layer range) of the delta arrived. That change is in the data plane
(``kvservice/transfer``, ``kvservice/transfer/lane/csrc``); see clients/vllm/README.md, "Layer-wise".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
from collections.abc import Sequence

from kvservice_client import BackgroundClient, Layout
from kvservice_client.layerwise import abort_all, all_done, layer_tid

__all__ = ["LayerSets", "abort_all", "all_done", "layer_ids", "layer_tid"]

log = logging.getLogger(__name__)


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_ids(names: Sequence[str]) -> list[int]:
    """The model's layer number of each of vLLM's layer names (``model.layers.12.self_attn.attn``
    -> 12), so every PP stage names a layer alike; names without one: their order (PP 1 only)."""
    found = [_LAYER_NUMBER.search(n) for n in names]
    if all(found):
        ids = [int(m.group(1)) for m in found]  # type: ignore[union-attr]
        if len(set(ids)) == len(ids):
            return ids
    return list(range(len(names)))


def one_layer(layout: Layout) -> Layout:
    """The layout of one layer's buffer set (same pages, heads and dtype)."""
    return dataclasses.replace(layout, num_layers=1)


@dataclasses.dataclass
class LayerSets:
    """This worker's per-layer buffer sets, by layer index (the order vLLM registered the caches)."""

    names: dict[str, int]  # vLLM's layer name -> layer index (on this worker)
    buffer_sets: list[str]  # layer index -> its one-layer buffer set id
    ids: list[int]  # layer index -> the model's layer number (the transfer's layer, layer_tid)

    def index(self, layer_name: str) -> int:
        return self.names[layer_name]

    def tids(self, transfer_id: str) -> list[str]:
        """This worker's layer transfers of ``transfer_id``, by layer index."""
        return [layer_tid(transfer_id, i) for i in self.ids]


class StreamSend:
    """The sender side of one request's layer-wise transfer: one :class:`ChunkedSend` per layer."""

    def __init__(self, bg: BackgroundClient, sets: LayerSets, transfer_id: str, peer: str, deadline_ms: int):
        self.bg, self.sets, self.transfer_id = bg, sets, transfer_id
        self.peer, self.deadline_ms = peer, deadline_ms
        self.layers = [bg.chunked(tid, deadline_ms) for tid in sets.tids(transfer_id)]
        self.done = all_done(bg, [c.done for c in self.layers], self.tids)

    @property
    def tids(self) -> list[str]:
        return self.sets.tids(self.transfer_id)

    def chunk(self, layer: int, offset: int, pages: Sequence[int], last: bool) -> None:
        """Queue layer ``layer``'s chunk (its pages ``offset..offset+len(pages)`` of the prompt)."""
        tid, bs = self.tids[layer], self.sets.buffer_sets[layer]
        self.layers[layer].send(
            lambda kv: kv.send_delta(
                tid, bs, src_page_indices=pages, peer_address=self.peer, chunk_offset=offset,
                last_chunk=last, deadline_ms=self.deadline_ms,
            ),
            last,
        )  # fmt: skip

    def abort(self, reason: str) -> concurrent.futures.Future[None]:
        """Abort every layer's transfer (settled when the future ends)."""
        for c in self.layers:
            c.cancel()
        return self.bg.submit(abort_all(self.bg, self.tids, reason))
