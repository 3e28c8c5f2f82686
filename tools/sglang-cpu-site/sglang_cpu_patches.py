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


def _host_memory(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, descs: Any, mem_type: str | None = None, *args: Any, **kwargs: Any) -> Any:
        return method(self, descs, "DRAM" if mem_type == "VRAM" else mem_type, *args, **kwargs)

    return call


def _nixl(module: ModuleType) -> None:
    agent = sys.modules["nixl._api"].nixl_agent  # nixl/__init__ puts its CUDA build's _api there
    for name in ("register_memory", "get_xfer_descs", "get_reg_descs"):
        setattr(agent, name, _host_memory(getattr(agent, name)))


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
