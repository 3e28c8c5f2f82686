"""vLLM's per-layer KV caches as a kvservice registration: the page layout their bytes follow and
each layer's memory as one flat region (no vLLM import: tensors of vLLM's shapes and strides are
all it needs, so it runs, and is tested, without the engine package).

    vLLM cache, per layer (tensor shape; physical order)         page layout   per layer
    [blocks, heads, bs, 2*d] dense, CPU attention backend        hnd_kv        one region
        (it views a head's block as [2*bs, d]: K rows, then V rows)
    [blocks, heads, bs, 2*d] GPU backends of vLLM >= 0.32         one region, K|V in each row:
        LBNHC order (the default: [blocks][bs][heads][K|V])       nhc
        LBHNC order ([blocks][heads][bs][K|V])                    hnc
    [2, blocks, bs, heads, d] K/V planes (FlashAttention < 0.32)  nhd / hnd     K and V regions
        (each plane dense; token-major or head-major)
    [blocks, 2, bs, heads, d] (FlashInfer < 0.32), NHD or HND     kv_nhd/kv_hnd one region
    MLA: [blocks, bs, latent] or [blocks, 1, bs, latent]          MLA           one region
        (replicated on every TP rank: the service moves each receiver rank's pages from one
        sender rank, the others report done without moving bytes; docs/decisions/0004)
    anything else with dense blocks, TP 1                         opaque pages (MLA-shaped rows)

Every layer must have the first layer's shape, dtype and strides. Layouts whose blocks are not
dense runs of the layer's region (vLLM's block-outermost BL** orders, padded pages) are refused
with the reason when TP > 1 needs heads; otherwise they move as opaque pages only if their blocks
are dense.
"""

from __future__ import annotations

import dataclasses

import torch
from kvservice_client import Layout

__all__ = ["KVHeads", "kv_layout"]


# torch's names -> kvservice's; fp8 caches may be stored as bytes (the service moves bytes)
_DTYPES = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float8_e4m3fn": "float8_e4m3",
    "float8_e5m2": "float8_e5m2",
    "uint8": "uint8",
    "int8": "uint8",
}


@dataclasses.dataclass(frozen=True)
class KVHeads:
    """The model's KV heads as this worker holds them (from vLLM's model and parallel config)."""

    total: int  # KV heads of the whole model
    local: int  # KV heads on this TP rank
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0


def kv_layout(
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
    heads: KVHeads | None = None,
    *,
    cpu_attention: bool | None = None,
    mla_tp: tuple[int, int] = (1, 0),
) -> tuple[Layout, list[torch.Tensor], list[torch.Tensor]]:
    """The kvservice Layout of vLLM's per-layer caches and each layer's K (and V) memory as flat
    tensors, in the cache's own byte order (the service converts page size and order for peers of
    other layouts). ``heads`` None: an MLA model (one latent row a token), on TP rank
    ``mla_tp`` = (size, rank) (its cache a replica). ``cpu_attention``: whether vLLM's CPU
    attention backend reads the cache (default: the cache is on the CPU)."""
    if not kv_caches:
        raise ValueError("kv_caches: vLLM registered no KV cache")
    tensors = list(kv_caches.values())
    first = tensors[0]
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
            raise ValueError(
                f"kv_caches[{name}]: shape {tuple(first.shape)} {t.dtype} stride {t.stride()} differs "
                "from the first layer's"
            )
    dtype = _DTYPES.get(str(first.dtype).removeprefix("torch."), "")
    if not dtype:
        raise ValueError(f"kv_caches: dtype {first.dtype} is not one kvservice moves ({sorted(_DTYPES)})")
    if cpu_attention is None:
        cpu_attention = first.device.type == "cpu"
    if heads is not None:
        per_head = _per_head(first, block_size, heads, cpu_attention)
        if per_head is not None:
            page_layout, planes = per_head
            k = [_flat(t[0] if planes else t) for t in tensors]
            v = [_flat(t[1]) for t in tensors] if planes else []
            layout = Layout.mha(
                num_layers=len(tensors),
                page_size=block_size,
                num_pages=int(first.shape[1] if planes else first.shape[0]),
                total_kv_heads=heads.total,
                head_dim=heads.head_dim,
                dtype=dtype,
                tp_size=heads.tp_size,
                tp_rank=heads.tp_rank,
                page_layout=page_layout,  # type: ignore[arg-type]
            )
            return layout, k, v
        if heads.tp_size > 1:
            raise ValueError(
                f"kv_caches: layout shape {tuple(first.shape)} stride {first.stride()} is not one "
                f"kvservice can slice by head, which TP {heads.tp_size} needs"
            )
    if heads is None and not 0 <= mla_tp[1] < mla_tp[0]:
        raise ValueError(f"mla_tp: rank {mla_tp[1]} of TP size {mla_tp[0]} is not a rank of it")
    return _opaque(kv_caches, block_size, dtype, mla_tp if heads is None else (1, 0)) + ([],)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory from its first element, as a 1-D view (the caller checked it is dense)."""
    return torch.as_strided(t, (t.numel(),), (1,))


def _in_order(t: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether ``t`` is dense with its dims laid out outermost-first in ``order``."""
    return t.permute(*order).is_contiguous()


def _per_head(t: torch.Tensor, bs: int, heads: KVHeads, cpu_attention: bool) -> tuple[str, bool] | None:
    """(page layout, whether K and V are separate planes) of one layer's cache, or None."""
    h, d = heads.local, heads.head_dim
    if t.dim() == 4 and tuple(t.shape[1:]) == (h, bs, 2 * d):  # [blocks, heads, bs, K|V]
        if cpu_attention:
            return ("hnd_kv", False) if t.is_contiguous() else None
        if _in_order(t, (0, 2, 1, 3)):
            return "nhc", False
        return ("hnc", False) if t.is_contiguous() else None
    if t.dim() == 5 and t.shape[0] == 2 and tuple(t.shape[2:]) == (bs, h, d):  # K/V planes
        if t[0].is_contiguous() and t[1].is_contiguous():
            return "nhd", True
        if _in_order(t[0], (0, 2, 1, 3)) and _in_order(t[1], (0, 2, 1, 3)):
            return "hnd", True
        return None
    if t.dim() == 5 and t.shape[1] == 2 and tuple(t.shape[2:]) == (bs, h, d):  # [blocks, 2, ...]
        if t.is_contiguous():
            return "kv_nhd", False
        return ("kv_hnd", False) if _in_order(t, (0, 1, 3, 2, 4)) else None
    return None


def _dense_blocks(t: torch.Tensor) -> bool:
    """Each block (dim 0) is one dense run of ``stride(0)`` elements, blocks back to back."""
    block = t[0]
    strides = block.stride()
    order = sorted(range(block.dim()), key=lambda i: -strides[i])
    return t.stride(0) == block.numel() and _in_order(block, tuple(order))


def _opaque(
    kv_caches: dict[str, torch.Tensor], block_size: int, dtype: str, tp: tuple[int, int]
) -> tuple[Layout, list[torch.Tensor]]:
    first = next(iter(kv_caches.values()))
    num_blocks = int(first.shape[0])
    block_elems = first[0].numel()
    if not _dense_blocks(first):
        raise ValueError(
            f"kv_caches: a block is not one contiguous run (shape {tuple(first.shape)}, stride "
            f"{first.stride()}); this layout (block-outermost or padded pages) is not supported by "
            "kvservice_vllm yet"
        )
    if block_elems % block_size:
        raise ValueError(
            f"kv_caches: a block of {block_elems} elements is not a multiple of block_size {block_size}"
        )
    layout = Layout.mla(
        num_layers=len(kv_caches),
        page_size=block_size,
        num_pages=num_blocks,
        latent_dim=block_elems // block_size,
        dtype=dtype,
        tp_size=tp[0],
        tp_rank=tp[1],
    )
    return layout, [_flat(t) for t in kv_caches.values()]
