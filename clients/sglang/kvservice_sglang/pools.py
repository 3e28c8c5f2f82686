"""SGLang's pools as kvservice needs them: host (CPU) pools in POSIX shared memory, and each KV
buffer's storage dtype.

kvservice maps an engine's host memory by the shared-memory object it lies in
(``kvservice_sglang.regions``); SGLang's CPU engine (``--device cpu``) allocates its KV pool and
its metadata buffers (the aux rows) with plain ``torch.zeros``, which no other process can open.
When the transfer backend is ``kvservice``, the allocations inside the hooked constructors
(:data:`TARGETS`) are made in ``/dev/shm`` instead: each ``torch.zeros`` / ``torch.empty`` /
``torch.full`` of a CPU tensor there becomes a tensor over a fresh shared-memory object (POSIX shm
is zero-filled; ``full`` is filled after). Everything else, and every pool on a GPU, is allocated
as SGLang does.

The hook also records what SGLang 0.5.23 does not put in the backend's ``KVArgs`` about every KV
buffer it saw made, by address (:func:`buffer_info`): the storage dtype (``kv_cache_dtype_str``
is the ``--kv-cache-dtype`` setting, ``auto`` unless set), the pool's KV heads on this rank
(its decode side leaves ``kv_head_num`` unset) and the model's layer number of the buffer (the
pool's ``start_layer`` plus its place: a pipeline stage's decode side sets no
``prefill_start_layer``).

The objects are named ``kvs-sglang-<pid>-<n>`` and unlinked when the process exits normally;
kvservice holds its own mapping, and re-registers from the names after a service restart, so the
names must live as long as the engine. A process killed with SIGKILL leaves its names behind:
whoever killed it removes ``/dev/shm/kvs-sglang-<pid>-*`` (:func:`leftovers`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "PREFIX",
    "TARGETS",
    "BufferInfo",
    "around_allocation",
    "buffer_info",
    "leftovers",
    "record_pool",
    "shared_allocations",
]

PREFIX = "kvs-sglang"
# the constructors whose CPU tensors the backend registers: the KV pools and the aux rows
TARGETS = (
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers",
    "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool._create_buffers",
    "sglang.srt.disaggregation.utils.MetadataBuffers.__init__",
)

_segments: list[shared_memory.SharedMemory] = []


class BufferInfo(NamedTuple):
    dtype: str  # torch's name, without "torch."
    head_num: int | None  # the pool's KV heads on this rank (None: an MLA pool)
    layer: int  # the model's layer number of the buffer (pool.start_layer + its index)


_buffers: dict[int, BufferInfo] = {}  # a KV buffer's address -> what its pool says of it
_counter = itertools.count()
_lock = threading.Lock()


def _shared(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes in a new shared-memory object, as a uint8 tensor."""
    with _lock:
        if not _segments:
            atexit.register(_unlink_all)
        name = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        shm = shared_memory.SharedMemory(create=True, size=max(1, nbytes), name=name)
        _segments.append(shm)
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(1, nbytes))[:nbytes]


def _unlink_all() -> None:
    with _lock:
        for shm in _segments:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
        _segments.clear()


def _shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The size a ``torch.zeros``-like call asks for (None: a form this module leaves alone)."""
    if "size" in kwargs:
        size = kwargs["size"]
    elif len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        size = args[0]
    elif args and all(isinstance(a, int) for a in args):
        size = args
    else:
        return None
    return tuple(int(n) for n in size)


class _SharedHostTensors(TorchFunctionMode):
    """CPU ``zeros`` / ``empty`` / ``full`` -> tensors over shared memory; anything else as is."""

    _ALLOCATORS = (torch.zeros, torch.empty, torch.full)
    _HANDLED = frozenset({"dtype", "device", "size", "pin_memory", "fill_value"})

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func not in self._ALLOCATORS or not set(kwargs) <= self._HANDLED:
            return func(*args, **kwargs)
        fill = None
        if func is torch.full:
            if len(args) != 2 and "fill_value" not in kwargs:
                return func(*args, **kwargs)
            fill = kwargs.pop("fill_value", None) if "fill_value" in kwargs else args[1]
            args = args[:1]
        shape = _shape(args, kwargs)
        device = torch.device(kwargs.get("device") or "cpu")
        if shape is None or device.type != "cpu":
            return func(*args, **kwargs) if fill is None else func(*args, fill, **kwargs)
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        count = 1
        for n in shape:
            count *= n
        out = _shared(count * torch.empty((), dtype=dtype).element_size()).view(dtype).view(shape)
        if fill is not None:
            out.fill_(fill)
        return out


def shared_allocations() -> contextlib.AbstractContextManager[None]:
    """Within it, CPU tensor allocations (``zeros``, ``empty``, ``full``) lie in shared memory."""
    return _SharedHostTensors()


def _kvservice_backend() -> bool:
    """Whether this SGLang process runs P/D disaggregation on the kvservice backend."""
    try:
        from sglang.srt.runtime_context import get_disagg

        bag = get_disagg()
        backend = str(getattr(bag, "disaggregation_transfer_backend", ""))
        mode = str(getattr(bag, "disaggregation_mode", "null"))
    except (ImportError, AttributeError, RuntimeError, AssertionError, KeyError):
        return False
    return backend == "kvservice" and mode != "null"


def around_allocation(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """SGLang ``HookRegistry`` AROUND hook for :data:`TARGETS`: the original, its CPU tensors in
    shared memory when the backend is kvservice (a GPU pool's allocations are CUDA: untouched);
    then what the pool (``args[0]``) says of each KV buffer it made (:func:`record_pool`)."""
    if not _kvservice_backend():
        return original(*args, **kwargs)
    with shared_allocations():
        out = original(*args, **kwargs)
    if args:
        record_pool(args[0])
    return out


def record_pool(pool: Any) -> None:
    """Note what ``pool`` (an SGLang KV pool, its buffers made) says of each of its KV buffers:
    dtype, KV heads on this rank, the model's layer number (``start_layer`` + the buffer's index)."""
    heads = getattr(pool, "head_num", None)
    start = int(getattr(pool, "start_layer", 0) or 0)
    for name in ("k_buffer", "v_buffer", "kv_buffer"):
        for i, buf in enumerate(getattr(pool, name, None) or ()):
            if isinstance(buf, torch.Tensor):
                dtype = str(buf.dtype).removeprefix("torch.")
                _buffers[int(buf.data_ptr())] = BufferInfo(
                    dtype, None if heads is None else int(heads), start + i
                )


def buffer_info(ptr: int) -> BufferInfo | None:
    """What the pool that made the KV buffer at ``ptr`` in this process says of it (None: no
    hooked pool made it)."""
    return _buffers.get(int(ptr))


def leftovers(pid: int) -> Iterator[Path]:
    """The shared-memory objects a process ``pid`` that did not exit normally left behind."""
    return Path("/dev/shm").glob(f"{PREFIX}-{int(pid)}-*")
