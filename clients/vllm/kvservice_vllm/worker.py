"""Worker side: the KV cache registered with the local kvservice, transfers run off-thread.

The model runner's thread only queues jobs and drains results: every RPC runs on a background
event loop (one :class:`~kvservice_client.AsyncClient`, whose session owns the buffer set and the
transfers). A transfer's end comes from one WatchTransfers stream.

On the CPU backend the service must map the engine's KV memory, so the cache is allocated in POSIX
shared memory: :meth:`WorkerSide.allocation_context` is vLLM's KV-allocation hook
(``get_mem_pool_context``), and turns the one ``torch.zeros(n, dtype=int8)`` backing buffer that
vLLM allocates inside it into a shared-memory buffer. On CUDA the cache stays where vLLM puts it
and is registered through CUDA IPC handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import threading
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Any

import torch
from kvservice_client import AsyncClient, KVClientError, Layout, Region, TransferStatus
from kvservice_client._regions import cuda_region, shm_region
from torch.overrides import TorchFunctionMode

from .meta import AbortJob, KVServiceMeta, RecvJob, SendJob

__all__ = ["Outcome", "WorkerSide", "kv_layout"]

log = logging.getLogger(__name__)
_MIN_SHARED_BYTES = 1 << 16  # smaller int8 zeros inside the hook are not the KV cache
_SAFETY_S = 5.0  # past a transfer's deadline, stop waiting for the service's word


@dataclasses.dataclass(frozen=True)
class Outcome:
    job: SendJob | RecvJob | AbortJob
    ok: bool
    why: str = ""


class _SharedZeros(TorchFunctionMode):
    """``torch.zeros(n, dtype=torch.int8, device="cpu")`` of KV-cache size -> a shared-memory
    tensor (POSIX shm is zero-filled). Anything else runs as usual."""

    def __init__(self, owner: WorkerSide) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func is torch.zeros
            and len(args) == 1
            and isinstance(args[0], int)
            and args[0] >= _MIN_SHARED_BYTES
            and kwargs.get("dtype") is torch.int8
            and torch.device(kwargs.get("device") or "cpu").type == "cpu"
            and set(kwargs) <= {"dtype", "device"}
        ):
            return self.owner._shared_buffer(args[0])
        return func(*args, **kwargs)


def kv_layout(kv_caches: dict[str, torch.Tensor], block_size: int) -> tuple[Layout, list[torch.Tensor]]:
    """The kvservice Layout of vLLM's per-layer caches, and each layer's blocks as one flat tensor.

    vLLM 0.32 views every layer as ``[num_blocks, ...]`` over one backing buffer (CPU: blocks of
    ``[heads, block_size, K|V]``; CUDA backends: ``[2, ...]`` K/V planes are refused below). A
    block of one layer must be one contiguous run of bytes: then the service moves it as one page
    of a per-token row of ``page_bytes / block_size`` (the MLA-shaped layout, one region a
    layer), which is byte-exact between instances of the same model and TP layout.
    """
    if not kv_caches:
        raise ValueError("kv_caches: vLLM registered no KV cache")
    tensors = list(kv_caches.values())
    first = tensors[0]
    num_blocks = int(first.shape[0])
    block_elems = first[0].numel()
    flats: list[torch.Tensor] = []
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"kv_caches[{name}]: shape {tuple(t.shape)} {t.dtype} differs from the first layer's"
            )
        if not t[0].is_contiguous() or t.stride(0) != block_elems:
            raise ValueError(
                f"kv_caches[{name}]: a block is not one contiguous run (shape {tuple(t.shape)}, "
                f"stride {t.stride()}); this layout (K/V planes or block-outermost packing) is not "
                "supported by kvservice_vllm yet"
            )
        flats.append(torch.as_strided(t, (num_blocks * block_elems,), (1,)))
    if block_elems % block_size:
        raise ValueError(
            f"kv_caches: a block of {block_elems} elements is not a multiple of block_size {block_size}"
        )
    layout = Layout.mla(
        num_layers=len(tensors),
        page_size=block_size,
        num_pages=num_blocks,
        latent_dim=block_elems // block_size,
        dtype=str(first.dtype).removeprefix("torch."),
    )
    return layout, flats


class _Loop:
    """A daemon thread running an event loop; ``call`` waits, ``spawn`` does not."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvservice-vllm", daemon=True)
        self._thread.start()

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Any) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class WorkerSide:
    def __init__(self, address: str, client_name: str, engine_id: str, rpc_timeout_s: float = 10.0) -> None:
        self.address, self.client_name, self.engine_id = address, client_name, engine_id
        self.rpc_timeout_s = rpc_timeout_s
        self._shm: list[shared_memory.SharedMemory] = []
        self._io = _Loop()
        self.kv: AsyncClient = self._io.call(self._open())
        self.buffer_set_id = ""
        self.layout: Layout | None = None
        self._waiters: dict[str, asyncio.Future[TransferStatus]] = {}
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._watch_ready = threading.Event()
        self._io.spawn(self._watch())
        self._watch_ready.wait(10)

    async def _open(self) -> AsyncClient:
        kv = AsyncClient(self.address, client_name=self.client_name, timeout=self.rpc_timeout_s)
        await kv.session_id()
        return kv

    # -- KV cache ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def allocation_context(self) -> Iterator[None]:
        with _SharedZeros(self):
            yield

    def _shared_buffer(self, nbytes: int) -> torch.Tensor:
        shm = shared_memory.SharedMemory(
            create=True, size=nbytes, name=f"kvs-vllm-{os.getpid()}-{len(self._shm)}"
        )
        self._shm.append(shm)
        return torch.frombuffer(shm.buf, dtype=torch.int8, count=nbytes)

    def register(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        layout, flats = kv_layout(kv_caches, block_size)
        regions = [self._region(f) for f in flats]
        bs = self._io.call(self.kv.register_buffers(layout, regions, [], engine_id=self.engine_id), 60)
        self.layout, self.buffer_set_id = layout, bs.buffer_set_id
        log.info(
            "kvservice: registered %d layers x %d blocks as %s",
            layout.num_layers,
            layout.num_pages,
            bs.buffer_set_id,
        )

    def _region(self, flat: torch.Tensor) -> Region:
        nbytes = flat.numel() * flat.element_size()
        if flat.is_cuda:
            return cuda_region(flat)
        for shm in self._shm:
            base = torch.frombuffer(shm.buf, dtype=torch.int8, count=1).data_ptr()
            off = flat.data_ptr() - base
            if 0 <= off and off + nbytes <= shm.size:
                return shm_region(shm.name, nbytes, off)
        raise ValueError(
            "kv_caches: the CPU KV cache is not in the connector's shared memory (vLLM did not "
            "allocate it inside get_mem_pool_context); kvservice cannot map it"
        )

    # -- transfers ---------------------------------------------------------------------------
    def submit(self, meta: KVServiceMeta) -> None:
        """Queue this step's jobs (returns at once)."""
        for job in (*meta.aborts, *meta.sends, *meta.recvs):
            self._io.spawn(self._run(job))

    def outcomes(self) -> list[Outcome]:
        out: list[Outcome] = []
        while True:
            try:
                out.append(self._outcomes.get_nowait())
            except queue.Empty:
                return out

    async def _run(self, job: SendJob | RecvJob | AbortJob) -> None:
        loop = asyncio.get_running_loop()
        tid = job.transfer_id
        waiter = self._waiters.setdefault(tid, loop.create_future())  # before the call: no lost event
        try:
            if isinstance(job, SendJob):
                st = await self.kv.send_delta(
                    tid,
                    self.buffer_set_id,
                    src_page_indices=job.pages,
                    peer_address=job.peer,
                    deadline_ms=job.deadline_ms,
                )
            elif isinstance(job, RecvJob):
                st = await self.kv.expect_delta(
                    tid,
                    self.buffer_set_id,
                    prefix_pages=job.prefix_pages,
                    dst_page_indices=job.pages,
                    deadline_ms=job.deadline_ms,
                )
            else:
                sts = await self.kv.abort(tid, job.reason)  # settled on return: no write after it
                self._waiters.pop(tid, None)
                self._outcomes.put(Outcome(job, True, sts[0].error if sts else ""))
                return
            st = await self._settle(st, waiter, loop.time() + job.deadline_ms / 1000 + _SAFETY_S)
            self._outcomes.put(Outcome(job, st.state == "DONE", st.error))
        except (KVClientError, asyncio.TimeoutError) as exc:
            self._outcomes.put(Outcome(job, False, f"{type(exc).__name__}: {exc}"))
        finally:
            self._waiters.pop(tid, None)

    async def _settle(
        self, st: TransferStatus, waiter: asyncio.Future[TransferStatus], end: float
    ) -> TransferStatus:
        """The transfer's terminal status: from the watch stream, or a poll each second (an event
        sent before the stream was open is not replayed)."""
        loop = asyncio.get_running_loop()
        while not st.terminal:
            if loop.time() > end:
                raise asyncio.TimeoutError(f"transfer {st.transfer_id} not settled past its deadline")
            try:
                return await asyncio.wait_for(asyncio.shield(waiter), 1.0)
            except asyncio.TimeoutError:
                found = await self.kv.poll([st.transfer_id])
                st = found[0] if found else st
        return st

    async def _watch(self) -> None:
        """One stream for every transfer of this session; resolves the jobs' waiters."""
        while True:
            try:
                self._watch_ready.set()
                async for st in self.kv.watch(include_current=False):
                    w = self._waiters.get(st.transfer_id)
                    if st.terminal and w is not None and not w.done():
                        w.set_result(st)
            except asyncio.CancelledError:
                return
            except KVClientError as exc:  # the session is lost: every job waiting fails now
                for w in list(self._waiters.values()):
                    if not w.done():
                        w.set_exception(exc)
                await asyncio.sleep(0.5)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._io.call(self.kv.close(), 10)
        self._io.stop()
        for shm in self._shm:
            with contextlib.suppress(Exception):
                shm.close()
            with contextlib.suppress(Exception):
                shm.unlink()
