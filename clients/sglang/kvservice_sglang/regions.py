"""SGLang's KVArgs (raw pointers, lengths, per-page item lengths) as a kvservice registration.

SGLang hands the transfer backend raw pointers. kvservice must map that memory in its own
process, so each pointer is resolved to something it can open:

* host memory: the POSIX shared-memory object it lies in, found in ``/proc/self/maps``. Memory
  that is not in ``/dev/shm`` (plain malloc) cannot be shared, and is refused with the reason.
* CUDA memory: a CUDA IPC handle of its allocation, with the offset inside it
  (``cuMemGetAddressRange``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvservice_client import AuxSpec, BackgroundClient, Layout, Region, pointer_region

__all__ = ["STATE_TYPES", "Registration", "kv_args_registration", "register_kv_args"]

# SGLang state types whose components are whole fixed-stride slots indexed by ``state_indices``
# (its NIXL backend's prepared-state set): each component tensor is registered as aux rows and
# the state rows travel like the aux row, slot for slot. DSA_TAIL (ring sub-ranges) and
# REQUEST_ROW (per-request rows of another addressing) are not slots and are refused.
STATE_TYPES = frozenset(
    {
        "mamba",
        "swa",
        "dsa",
        "qsa_pending",
        "qsa_compressed",
        "swa_ring",
        "c128_state",
        "block_scale",
        "block_scale_swa",
        "minimax_index_k",
        "minimax_dense_kv",
    }
)

_ITEMSIZE = {
    "float8_e4m3": 1,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


@dataclasses.dataclass(frozen=True)
class Registration:
    layout: Layout
    k_regions: list[Region]
    v_regions: list[Region]
    aux: list[AuxSpec]
    aux_names: list[str]
    state_names: list[list[str]] = dataclasses.field(default_factory=list)  # per state type


def _dtype(name: str) -> str:
    """SGLang's cache dtype as kvservice names it (its fp8 names, torch's, or the storage dtype)."""
    d = str(name).removeprefix("torch.")
    d = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "half": "float16", "float": "float32"}.get(
        d, d
    )
    if d not in _ITEMSIZE:
        raise ValueError(f"kv_cache_dtype_str: {name!r} is not a dtype kvservice knows")
    return {"float8_e4m3fn": "float8_e4m3", "int8": "uint8"}.get(d, d)


def _storage_dtype(args: Any) -> str:
    """The dtype of the KV bytes: SGLang's ``kv_cache_dtype_str`` is its ``--kv-cache-dtype``
    setting, ``auto`` (the model's dtype) unless set; then the pool's own, as the plugin's hook
    recorded it (``pools.buffer_dtype``)."""
    name = str(args.kv_cache_dtype_str)
    if name != "auto":
        return name
    return _pool_info(args, "kv_cache_dtype_str: 'auto' names no dtype").dtype


def _pool_info(args: Any, why: str) -> Any:
    """``pools.buffer_info`` of the first KV buffer (SGLang's pools, as the plugin's hook saw them)."""
    from .pools import buffer_info

    found = buffer_info(int(args.kv_data_ptrs[0])) if args.kv_data_ptrs else None
    if found is None:
        raise ValueError(
            f"{why}, and no KV pool this process made is at kv_data_ptrs[0] "
            "(is the kvservice_sglang plugin loaded?)"
        )
    return found


def _kv_heads(args: Any, attn_tp: tuple[int, int] | None) -> tuple[int, int]:
    """(KV heads on this rank, KV heads in all). SGLang's decode side leaves both unset: the
    pool's own head count, and (``total_kv_head_num`` unset) that times the attention TP size
    (``attn_tp``; the manager fills it from the model config where heads are replicated)."""
    local = getattr(args, "kv_head_num", None)
    if local is None:
        local = _pool_info(args, "kv_head_num: unset").head_num
        if local is None:
            raise ValueError("kv_head_num: unset, and the pool at kv_data_ptrs[0] has no head count")
    total = getattr(args, "total_kv_head_num", None)
    if total is None:
        total = int(local) * (attn_tp[0] if attn_tp is not None else 1)
    return int(local), int(total)


def _region(ptr: int, nbytes: int, gpu: int, field: str = "kv_data_ptrs") -> Region:
    try:
        return pointer_region(ptr, nbytes, gpu)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def _state_aux(args: Any, gpu: int) -> tuple[list[AuxSpec], list[list[str]]]:
    """Every component tensor of every state type as aux rows ``state<type>.<component>``."""
    specs: list[AuxSpec] = []
    names: list[list[str]] = []
    ptrs = list(getattr(args, "state_data_ptrs", None) or [])
    types = list(getattr(args, "state_types", None) or [])
    for i, comp in enumerate(ptrs):
        kind = str(getattr(types[i], "value", types[i])) if i < len(types) else "?"
        if comp and kind not in STATE_TYPES:
            raise ValueError(
                f"state_types[{i}]: {kind!r} is not a whole-slot state kvservice can move "
                f"(supported: {sorted(STATE_TYPES)})"
            )
        lens, items = list(args.state_data_lens[i]), list(args.state_item_lens[i])
        names.append([])
        for j, (p, n, row) in enumerate(zip(comp, lens, items, strict=True)):
            if int(row) <= 0 or int(n) % int(row):
                raise ValueError(f"state_item_lens[{i}][{j}]: {row} does not divide the buffer's {n} bytes")
            names[-1].append(f"state{i}.{j}")
            specs.append(
                AuxSpec(
                    name=names[-1][-1],
                    region=_region(int(p), int(n), gpu, f"state_data_ptrs[{i}][{j}]"),
                    row_bytes=int(row),
                    num_rows=int(n) // int(row),
                )
            )
    return specs, names


def kv_args_registration(args: Any, is_mla: bool, attn_tp: tuple[int, int] | None = None) -> Registration:
    """Layout and regions of SGLang's pools: per layer ``[pages * page_size, heads, head_dim]``
    buffers, K then V (MHA) or one latent buffer (MLA); aux buffers and the components of state
    buffers (Mamba, SWA, DSA, ...: ``STATE_TYPES``) as rows.

    ``attn_tp``: (attention TP size, this rank's attention TP rank). An MLA pool is a replica on
    every attention TP rank, registered as that rank (the service serves each receiver rank from
    one replica, design-notes §4); MHA heads are split by it (replicated when it exceeds the KV
    heads). None: TP 1 for MLA, and for MHA the size the head counts imply (total / local)."""
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    if not ptrs or len(set(items)) != 1 or len(set(lens)) != 1:
        raise ValueError(
            "kv_data_ptrs: kvservice needs one buffer a layer (K, V) of equal size and item length"
        )
    dtype = _dtype(_storage_dtype(args))
    page, item = int(args.page_size), int(items[0])
    num_pages = int(lens[0]) // item
    gpu = int(getattr(args, "gpu_id", 0) or 0)
    regions = [_region(int(p), int(n), gpu) for p, n in zip(ptrs, lens, strict=True)]
    if attn_tp is not None and not (attn_tp[0] >= 1 and 0 <= attn_tp[1] < attn_tp[0]):
        raise ValueError(f"attn_tp: rank {attn_tp[1]} of attention TP size {attn_tp[0]} is not a rank of it")
    if is_mla:
        tp_size, tp_rank = attn_tp or (1, 0)
        layout = Layout.mla(
            num_layers=len(ptrs),
            page_size=page,
            num_pages=num_pages,
            latent_dim=item // (page * _ITEMSIZE[dtype]),
            dtype=dtype,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        k, v = regions, []
    else:
        if len(ptrs) % 2:
            raise ValueError(f"kv_data_ptrs: {len(ptrs)} buffers is not K and V for each layer")
        local, total = _kv_heads(args, attn_tp)
        head_dim = item // (page * local * _ITEMSIZE[dtype])
        if attn_tp is None:
            tp_size = max(1, total // local)
            tp_rank = int(args.engine_rank) % tp_size
        else:
            tp_size, tp_rank = attn_tp
            if max(1, total // tp_size) != local:
                raise ValueError(
                    f"kv_head_num: {local} KV heads a rank, but {total} over attention TP {tp_size} "
                    f"is {max(1, total // tp_size)}"
                )
        layout = Layout.mha(
            num_layers=len(ptrs) // 2,
            page_size=page,
            num_pages=num_pages,
            total_kv_heads=total,
            head_dim=head_dim,
            dtype=dtype,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        k, v = regions[: len(ptrs) // 2], regions[len(ptrs) // 2 :]
    aux, names = [], []
    for i, (p, n, row) in enumerate(
        zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, strict=True)
    ):
        names.append(f"aux{i}")
        aux.append(
            AuxSpec(
                name=names[-1],
                region=_region(int(p), int(n), gpu),
                row_bytes=int(row),
                num_rows=int(n) // int(row),
            )
        )
    state_specs, state_names = _state_aux(args, gpu)
    return Registration(layout, k, v, aux + state_specs, names, state_names)


def register_kv_args(
    bg: BackgroundClient,
    args: Any,
    is_mla: bool,
    attn_tp: tuple[int, int] | None = None,
    timeout_s: float = 60.0,
) -> tuple[Registration, str]:
    """RegisterBuffers of SGLang's pools (``kv_args_registration``) on ``bg``'s session: the
    registration and its ``buffer_set_id``. CUDA pools go through IPC handles, host pools by their
    shared-memory object."""
    reg = kv_args_registration(args, is_mla, attn_tp)
    bs = bg.call(bg.kv.register_buffers(reg.layout, reg.k_regions, reg.v_regions, reg.aux), timeout_s)
    return reg, bs.buffer_set_id
