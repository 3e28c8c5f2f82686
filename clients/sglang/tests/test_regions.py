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
