"""SGLang's KVArgs as a kvservice registration (no SGLang import: the backend's regions module)."""

from __future__ import annotations

import types
from multiprocessing import shared_memory

import numpy as np
import pytest
from kvservice_sglang.regions import kv_args_registration


@pytest.fixture
def pool():  # type: ignore[no-untyped-def]
    shm = shared_memory.SharedMemory(create=True, size=4 * 64 * 4 * 128)  # 4 buffers of 64 slots
    yield shm
    shm.close()
    shm.unlink()


def _args(shm: shared_memory.SharedMemory, dtype: str, item: int) -> types.SimpleNamespace:
    addr = np.frombuffer(shm.buf, dtype=np.uint8).ctypes.data
    n = shm.size // 4
    return types.SimpleNamespace(
        engine_rank=0,
        gpu_id=0,
        page_size=1,
        kv_data_ptrs=[addr + i * n for i in range(4)],
        kv_data_lens=[n] * 4,
        kv_item_lens=[item] * 4,
        kv_cache_dtype_str=dtype,
        kv_head_num=2,
        total_kv_head_num=2,
        aux_data_ptrs=[],
        aux_data_lens=[],
        aux_item_lens=[],
    )


@pytest.mark.parametrize(
    ("given", "want"),
    [("fp8_e4m3", "float8_e4m3"), ("torch.float8_e4m3fn", "float8_e4m3"), ("torch.bfloat16", "bfloat16")],
)
def test_cache_dtypes_take_kvservice_names(pool, given: str, want: str) -> None:  # type: ignore[no-untyped-def]
    """Every dtype SGLang names reaches the service as one it knows (never DTYPE_UNSPECIFIED)."""
    isz = 1 if "8" in given else 2
    reg = kv_args_registration(_args(pool, given, 2 * 64 * isz), is_mla=False)
    assert reg.layout.dtype == want and reg.layout.to_proto().dtype != 0
    assert (reg.layout.local_kv_heads, reg.layout.head_dim_k) == (2, 64)


def test_unknown_dtype_names_the_field(pool) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="kv_cache_dtype_str"):
        kv_args_registration(_args(pool, "torch.float64", 2 * 64 * 8), is_mla=False)


def test_an_mla_pool_registers_as_its_attention_tp_rank(pool) -> None:  # type: ignore[no-untyped-def]
    """Every attention TP rank holds a replica of the latent pool: registered as that rank, so
    the service serves each receiver rank from one replica (two rank-0 senders fail the room)."""
    args = _args(pool, "torch.bfloat16", 576 * 2)
    assert kv_args_registration(args, is_mla=True).layout.tp_size == 1  # no attention TP given
    args.engine_rank = 5  # the prefill's engine_rank is its TP rank: modulo the size upstream
    reg = kv_args_registration(args, is_mla=True, attn_tp=(4, 1))
    assert reg.layout.kind == "mla" and (reg.layout.tp_size, reg.layout.tp_rank) == (4, 1)
    with pytest.raises(ValueError, match="attn_tp"):
        kv_args_registration(args, is_mla=True, attn_tp=(2, 2))


def test_mha_heads_follow_the_attention_tp_replicated_past_the_head_count(pool) -> None:  # type: ignore[no-untyped-def]
    args = _args(pool, "torch.bfloat16", 2 * 64 * 2)
    args.kv_head_num, args.total_kv_head_num = 1, 2  # TP 4 over 2 KV heads: each held twice
    reg = kv_args_registration(args, is_mla=False, attn_tp=(4, 3))
    assert (reg.layout.tp_size, reg.layout.tp_rank, reg.layout.local_kv_heads) == (4, 3, 1)
    assert kv_args_registration(args, is_mla=False).layout.tp_size == 2  # the heads alone: 2, wrong
    with pytest.raises(ValueError, match="kv_head_num"):
        kv_args_registration(args, is_mla=False, attn_tp=(1, 0))  # 1 head a rank is not 2 over TP 1
