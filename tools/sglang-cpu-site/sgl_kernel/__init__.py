"""A stand-in for ``sgl_kernel`` (sglang-kernel) in a CPU-only SGLang 0.5.23 venv.

sglang-kernel's wheels on PyPI are CUDA-only (their import needs ``libcuda.so.1``). On a CPU
without AMX, SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) calls exactly two of its ops; they
are written here in torch, after the semantics of SGLang's own Triton versions
(``assign_req_to_token_pool`` in ``sglang/srt/mem_cache/allocation.py``,
``copy_all_layer_kv_cache_tiled`` in ``sglang/kernels/ops/kvcache/cache_move.py``). SGLang's
speculative-decoding kernels import six more names at their top and never call them on this path:
those are callables that raise, naming themselves, so a path that does call one fails loudly
instead of computing something wrong. Any other name is missing, as it would be from a build
without it (SGLang probes some with ``hasattr`` / ``ImportError``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+kvservice-cpu-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` = request i's run of
    ``out_cache_loc`` (the runs lie back to back, in request order)::

        out_cache_loc  | req 0: end0-start0 | req 1: end1-start1 | ...
    """
    del pool_len  # the row length of req_to_token, which the tensor carries itself
    pos = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = int(end) - int(start)
        if n > 0:
            req_to_token[int(row), int(start) : int(end)] = out_cache_loc[pos : pos + n].to(
                req_to_token.dtype
            )
        pos += max(n, 0)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer ``b`` (address ``data_ptrs[b]``, ``strides[b]`` bytes a slot): slot
    ``tgt_loc[j]`` = slot ``src_loc[j]``. Every source is read before any target is written (safe
    when they overlap, as SGLang's tiled kernel is)."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.int64), src_loc.to(torch.int64)
    rows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        slots = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        slots[tgt] = slots[src]  # advanced indexing reads a copy first


def _not_on_cpu(name: str) -> Any:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not in the CPU stand-in (tools/sglang-cpu-site); this path needs "
            "sglang-kernel's real build"
        )

    op.__name__ = op.__qualname__ = name
    return op


# imported at the top of SGLang's speculative-decoding kernels (sglang/kernels/ops/speculative),
# which every scheduler imports; called only when speculative decoding runs
for _name in (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
):
    globals()[_name] = _not_on_cpu(_name)
del _name
