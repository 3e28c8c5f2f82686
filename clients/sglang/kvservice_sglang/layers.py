"""Pipeline parallelism: a room as one kvservice transfer per layer, named by the model's layer.

A PP stage holds some of the model's layers, so the whole-cache transfer of a room
(``sgl-<room>``) cannot pair two instances split differently. As in kvservice_vllm
(``layers.py``), such a room is one transfer per layer, ``sgl-<room>#L<layer>``, each on a
buffer set of that one layer (registered beside the whole-cache set, over the same memory), and
``<layer>`` is the model's layer number, so each layer meets the stage that holds it whatever the
two PP sizes::

    prefill PP 2 (stage 0: layers 0-1, stage 1: 2-3)      decode PP 1 (layers 0-3)
      stage 0 ─ sgl-7#L0, sgl-7#L1 ─┐
      stage 1 ─ sgl-7#L2, sgl-7#L3 ─┴──▶ one stage declares sgl-7#L0..#L3

    prefill PP 1 (layers 0-3)                             decode PP 2
      sgl-7#L0, #L1 ─▶ stage 0 (its peer)     sgl-7#L2, #L3 ─▶ stage 1 (its peer)

Every layer transfer of a room has the same prefix and pages (``prefix_pages``: the decode's
``decode_prefix_len``; the decode's ``kv_indices``), and TP ranks slice heads per layer as they do
for a whole transfer. A decode stage's metadata rows (and so its first token) ride the transfer of
its first layer (:func:`aux_layer`). The room's outcome is every layer transfer's
(:func:`all_done`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from kvservice_client import AuxSpec, BackgroundClient, Region
from kvservice_client.layerwise import abort_all, all_done, layer_tid

from .regions import Registration

__all__ = ["LayerSets", "abort_all", "all_done", "aux_layer", "layer_tid", "register_layers", "stage_layers"]

log = logging.getLogger(__name__)


def aux_layer(layers: Sequence[int]) -> int:
    """The layer whose transfer carries a decode stage's metadata rows: its first."""
    return min(layers)


def stage_layers(args: Any, num_layers: int, pp_size: int) -> list[int]:
    """The model's layer number of each of this rank's ``num_layers`` layers, in ``kv_data_ptrs``
    order: SGLang's ``kv_layer_ids`` where it gives them (one an entry, K then V), else the
    prefill's ``prefill_start_layer`` on, else what the plugin's hook saw of the pools
    (``pools.record_pool``: the pool's ``start_layer`` on; the decode's KVArgs names none), else, at
    PP 1, 0 on. Raises ``ValueError`` at PP > 1 when none says."""
    given = [int(i) for i in getattr(args, "kv_layer_ids", None) or ()]
    if given:
        if len(given) not in (num_layers, 2 * num_layers) or len(set(given[:num_layers])) != num_layers:
            raise ValueError(
                f"kv_layer_ids: {len(given)} ids for {num_layers} layers ({len(args.kv_data_ptrs)} buffers)"
            )
        return given[:num_layers]
    start = getattr(args, "prefill_start_layer", None)
    if start is not None:
        return list(range(int(start), int(start) + num_layers))
    from .pools import buffer_info

    seen = [buffer_info(int(p)) for p in list(args.kv_data_ptrs)[:num_layers]]
    if all(seen):
        return [s.layer for s in seen]  # type: ignore[union-attr]
    if pp_size == 1:
        return list(range(num_layers))
    raise ValueError(
        f"pp_size {pp_size}: this stage's layer numbers are unknown (no kv_layer_ids, no "
        "prefill_start_layer, and no pool the kvservice_sglang plugin saw made is at kv_data_ptrs)"
    )


@dataclasses.dataclass(frozen=True)
class LayerSets:
    """One buffer set per layer of a registration: ``ids[i]`` is the model's layer number of the
    registration's layer ``i``, ``buffer_sets[i]`` its one-layer set."""

    ids: tuple[int, ...]
    buffer_sets: tuple[str, ...]

    def of(self, layer: int) -> str:
        """The buffer set of the model's layer ``layer`` (``KeyError``: not on this rank)."""
        try:
            return self.buffer_sets[self.ids.index(layer)]
        except ValueError:
            raise KeyError(f"layer {layer} is not on this rank (it holds {list(self.ids)})") from None


async def register_layers(bg: BackgroundClient, reg: Registration, ids: Sequence[int]) -> LayerSets:
    """RegisterBuffers of each layer of ``reg`` on its own (same pages, heads, dtype; every aux
    region, since any layer may be a decode stage's first)."""
    one = dataclasses.replace(reg.layout, num_layers=1)
    v = reg.v_regions

    def regions(i: int) -> tuple[list[Region], list[Region], list[AuxSpec]]:
        return [reg.k_regions[i]], [v[i]] if v else [], list(reg.aux)

    sets = await asyncio.gather(*(bg.kv.register_buffers(one, *regions(i)) for i in range(len(ids))))
    return LayerSets(tuple(int(i) for i in ids), tuple(s.buffer_set_id for s in sets))
