"""Import-time patches of two CUDA assumptions in SGLang 0.5.23's own transfer backends on CPU
(``SGLANG_USE_CPU_ENGINE=1``), loaded at interpreter start by the venv's ``.pth``
(scripts/setup-sglang-cpu.sh). Our kvservice backend needs neither; SGLang's ``mooncake`` and
``nixl`` backends, run beside it for comparison, do:

* mooncake: the prefill records a ``torch.cuda.Event`` over pinned page indices when the sender
  ``supports_host_tensor_indices`` (sglang/srt/disaggregation/prefill.py); off, it takes the
  plain path.
* nixl: it registers and describes the KV cache as ``"VRAM"``, which on a CPU engine is host
  memory (UCX reports "VRAM memory is detected as host"): the agent's calls take ``"DRAM"`` there.

Each patch runs right after its module is first imported (a meta-path finder wraps the loader).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def _mooncake(module: ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _host_memory(method: Callable[..., Any], at: int) -> Callable[..., Any]:
    """``method`` with its memory type (positional argument ``at``, or ``mem_type=``) "DRAM"
    where SGLang says "VRAM"."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) > at and args[at] == "VRAM":
            args = (*args[:at], "DRAM", *args[at + 1 :])
        if kwargs.get("mem_type") == "VRAM":
            kwargs["mem_type"] = "DRAM"
        return method(self, *args, **kwargs)

    return call


def _nixl(module: ModuleType) -> None:
    agent = sys.modules["nixl._api"].nixl_agent  # nixl/__init__ puts its CUDA build's _api there
    # (descs, mem_type) for the first three; prep_xfer_dlist(agent_name, xfer_list, mem_type), which
    # SGLang calls on both sides with the kind it registered (its strided descriptors)
    where = {"register_memory": 1, "get_xfer_descs": 1, "get_reg_descs": 1, "prep_xfer_dlist": 2}
    for name, at in where.items():
        setattr(agent, name, _host_memory(getattr(agent, name), at))


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.disaggregation.mooncake.conn": _mooncake,
    "nixl": _nixl,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _AfterImport())
