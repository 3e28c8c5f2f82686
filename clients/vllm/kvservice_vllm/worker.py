"""Worker side: the KV cache registered with the local kvservice, transfers run off-thread.

The model runner's thread only queues jobs and drains results: every RPC runs on a background
event loop (one :class:`~kvservice_client.AsyncClient`, whose session owns the buffer set and the
transfers). A transfer's end comes from one WatchTransfers stream.

On the CPU backend the service must map the engine's KV memory, so the cache is allocated in POSIX
shared memory: :meth:`WorkerSide.allocation_context` is vLLM's KV-allocation hook
(``get_mem_pool_context``), and turns the one ``torch.zeros(n, dtype=int8)`` backing buffer that
vLLM allocates inside it into a shared-memory buffer. On CUDA the cache stays where vLLM puts it
and is registered through CUDA IPC handles.

A load (RecvJob, LandJob, a ClaimJob received directly) names the prefill's kvservice as
ExpectDelta's ``sender_address`` when the scheduler side learned it (``kvservice_sender``), so
the decode's service lets only that service fetch the plan (docs/design/security.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import secrets
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

import torch
from kvservice_client import BackgroundClient, Layout, NotFound, Region, pointer_region
from torch.overrides import TorchFunctionMode

from .jobs import AbortJob, ClaimJob, LandJob, RecvJob, SendJob, StreamEnd
from .layers import LayerSets, StreamSend, abort_all, all_done, layer_ids, one_layer
from .layout import KVHeads, kv_layout
from .sched_timer import flush_trace, trace, tracing

if TYPE_CHECKING:
    from .meta import KVServiceMeta

__all__ = ["KVHeads", "Outcome", "WorkerSide", "kv_layout"]

log = logging.getLogger(__name__)
_MIN_SHARED_BYTES = 1 << 16  # smaller int8 zeros inside the hook are not the KV cache


@dataclasses.dataclass(frozen=True)
class Outcome:
    job: SendJob | RecvJob | ClaimJob
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


class WorkerSide:
    def __init__(self, address: str, client_name: str, engine_id: str, rpc_timeout_s: float = 10.0) -> None:
        self.engine_id = engine_id
        self._shm: list[shared_memory.SharedMemory] = []
        self.bg = BackgroundClient(address, client_name=client_name, timeout=rpc_timeout_s)
        self.buffer_set_id = ""
        self.layout: Layout | None = None
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._aborts: dict[str, Any] = {}  # transfer id -> the Abort call of a load being stopped
        self._lands: dict[str, Any] = {}  # transfer id -> its landing declaration (landing option)
        self.layer_sets: LayerSets | None = None  # one-layer buffer sets (layer-wise transfers)
        self._streams: dict[str, StreamSend] = {}  # prefill: transfer id -> its layer-wise send
        self._layerwise: set[str] = set()  # decode: loads declared layer by layer (their aborts too)
        # the step's meta (held: an id() could be reused by the next step's) and its layers sent
        self._step_meta: KVServiceMeta | None = None
        self._step_sent: set[int] = set()

    # -- KV cache ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def allocation_context(self) -> Iterator[None]:
        with _SharedZeros(self):
            yield

    def _shared_buffer(self, nbytes: int) -> torch.Tensor:
        name = f"kvs-vllm-{os.getpid()}-{secrets.token_hex(4)}"  # unique: several workers a process
        shm = shared_memory.SharedMemory(create=True, size=nbytes, name=name)
        self._shm.append(shm)
        return torch.frombuffer(shm.buf, dtype=torch.int8, count=nbytes)

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        block_size: int,
        heads: KVHeads | None = None,
        cpu_attention: bool | None = None,
        mla_tp: tuple[int, int] = (1, 0),
    ) -> None:
        """RegisterBuffers of vLLM's caches (``layout.kv_layout``); on CUDA through IPC handles."""
        layout, k, v = kv_layout(kv_caches, block_size, heads, cpu_attention=cpu_attention, mla_tp=mla_tp)
        regions = [self._region(f) for f in k]
        v_regions = [self._region(f) for f in v]
        bs = self.bg.call(
            self.bg.kv.register_buffers(layout, regions, v_regions, engine_id=self.engine_id), 60
        )
        self.layout, self.buffer_set_id = layout, bs.buffer_set_id
        ids = layer_ids(list(kv_caches))  # the model's layer numbers (a PP stage holds some)
        sets = self.bg.call(
            _register_layers(self.bg, one_layer(layout), regions, v_regions, self.engine_id, ids),
            60 + len(regions),
        )
        self.layer_sets = LayerSets({name: i for i, name in enumerate(kv_caches)}, sets, ids)
        log.info(
            "kvservice: registered %d layers x %d blocks (%s) as %s",
            layout.num_layers,
            layout.num_pages,
            layout.page_layout if layout.kind == "mha" else f"MLA / opaque blocks, TP rank {layout.tp_rank}",
            bs.buffer_set_id,
        )

    def _region(self, flat: torch.Tensor) -> Region:
        try:
            return pointer_region(flat.data_ptr(), flat.numel() * flat.element_size(), flat.device.index or 0)
        except ValueError as exc:
            raise ValueError(
                f"kv_caches: {exc} (on CPU, vLLM must allocate the cache inside get_mem_pool_context)"
            ) from None

    # -- transfers ---------------------------------------------------------------------------
    def submit(self, meta: KVServiceMeta) -> None:
        """Start this step's jobs (returns at once; outcomes arrive in :meth:`outcomes`)."""
        bs = self.buffer_set_id
        for land in meta.lands:  # declared now; claimed (or received) once blocks are allocated
            self._lands[land.transfer_id] = self.bg.submit(_land(self.bg, bs, land))
        for abort in meta.aborts:  # settled when Abort returns: no write lands after it
            if abort.transfer_id in self._layerwise and self.layer_sets is not None:
                tids = self.layer_sets.tids(abort.transfer_id)
                self._aborts[abort.transfer_id] = self.bg.submit(abort_all(self.bg, tids, abort.reason))
                continue
            self._aborts[abort.transfer_id] = self.bg.submit(
                _abort(self.bg, abort, self._lands.pop(abort.transfer_id, None))
            )
        for claim in meta.claims:
            done = self.bg.submit(self._claim(claim, self._lands.pop(claim.transfer_id, None)))
            done.add_done_callback(lambda f, j=claim: self._finish(j, f))
        for end in meta.stream_ends:
            self._stream_end(end)
        jobs: list[SendJob | RecvJob] = [*meta.sends, *meta.recvs]
        for job in jobs:
            fut: Any
            if isinstance(job, RecvJob) and job.layerwise:
                fut = self._recv_layers(job)
            elif isinstance(job, SendJob) and job.layerwise:
                fut = self._send_layers(job)
            elif isinstance(job, SendJob):
                fut = self.bg.transfer(
                    job.transfer_id,
                    lambda kv, j=job: kv.send_delta(  # type: ignore[misc]
                        j.transfer_id,
                        bs,
                        src_page_indices=j.pages,
                        peer_address=j.peer,
                        deadline_ms=j.deadline_ms,
                    ),
                    job.deadline_ms,
                )
            else:
                fut = self.bg.transfer(
                    job.transfer_id,
                    lambda kv, j=job: kv.expect_delta(  # type: ignore[misc]
                        j.transfer_id,
                        bs,
                        prefix_pages=j.prefix_pages,
                        dst_page_indices=j.pages,
                        deadline_ms=j.deadline_ms,
                        sender_address=j.sender,
                    ),
                    job.deadline_ms,
                )
            trace("submitted", job.transfer_id)
            fut.add_done_callback(lambda f, j=job: self._finish(j, f))

    # -- layer-wise streaming (layers.py) ----------------------------------------------------
    def save_layer(self, layer_name: str, meta: KVServiceMeta) -> None:
        """Layer ``layer_name`` is computed: its chunk of each of the step's streams goes now."""
        assert self.layer_sets is not None
        self._send_layer(self.layer_sets.index(layer_name), meta)

    def end_step(self, meta: KVServiceMeta) -> None:
        """The step's forward ended: any layer not sent yet goes now (vLLM skipped its hook)."""
        assert self.layer_sets is not None
        sent = self._step_sent if self._step_meta is meta else set()
        for layer in range(len(self.layer_sets.buffer_sets)):
            if layer not in sent:
                self._send_layer(layer, meta)
        self._step_meta, self._step_sent = None, set()

    def _send_layer(self, layer: int, meta: KVServiceMeta) -> None:
        assert self.layer_sets is not None
        if self._step_meta is not meta:  # the step's first layer: its new streams open
            self._step_meta, self._step_sent = meta, set()
            for c in meta.chunks:
                if c.transfer_id not in self._streams:
                    self._streams[c.transfer_id] = StreamSend(
                        self.bg, self.layer_sets, c.transfer_id, c.peer, c.deadline_ms
                    )
                    trace("stream_open", c.transfer_id)
        if layer in self._step_sent:
            return
        self._step_sent.add(layer)
        for c in meta.chunks:
            self._streams[c.transfer_id].chunk(layer, c.chunk_offset, c.pages, c.last)

    def _stream_end(self, end: StreamEnd) -> None:
        """Report a streamed request's send once every layer transfer ended (or was aborted)."""
        stream = self._streams.pop(end.transfer_id, None)
        job = SendJob(end.req_id, end.transfer_id, (), stream.peer if stream else "", 0)
        if stream is None:  # nothing was sent: its blocks may go now
            self._outcomes.put(Outcome(job, not end.reason, end.reason))
        elif end.reason:
            stream.abort(end.reason).add_done_callback(
                lambda _: self._outcomes.put(Outcome(job, False, end.reason))
            )
        else:
            stream.done.add_done_callback(lambda f: self._finish(job, f))

    def _recv_layers(self, job: RecvJob) -> Any:
        """One ExpectDelta per layer (the same prefix and blocks); one outcome for all."""
        assert self.layer_sets is not None
        self._layerwise.add(job.transfer_id)
        tids = self.layer_sets.tids(job.transfer_id)
        futs = [
            self.bg.transfer(
                tid,
                lambda kv, t=tid, bs=bs: kv.expect_delta(  # type: ignore[misc]
                    t, bs, prefix_pages=job.prefix_pages, dst_page_indices=job.pages,
                    deadline_ms=job.deadline_ms, sender_address=job.sender,
                ),
                job.deadline_ms,
            )
            for tid, bs in zip(tids, self.layer_sets.buffer_sets, strict=True)
        ]  # fmt: skip
        return all_done(self.bg, futs, tids)

    def _send_layers(self, job: SendJob) -> Any:
        """A finished request's pages as one transfer per layer (PP, or asked layer-wise), each
        of one chunk; one outcome for all."""
        assert self.layer_sets is not None
        tids = self.layer_sets.tids(job.transfer_id)
        futs = [
            self.bg.transfer(
                tid,
                lambda kv, t=tid, bs=bs: kv.send_delta(  # type: ignore[misc]
                    t, bs, src_page_indices=job.pages, peer_address=job.peer, deadline_ms=job.deadline_ms
                ),
                job.deadline_ms,
            )
            for tid, bs in zip(tids, self.layer_sets.buffer_sets, strict=True)
        ]
        return all_done(self.bg, futs, tids)

    async def _claim(self, job: ClaimJob, landing: Any) -> Any:
        """The landed pages into the allocated blocks; if the landing was refused (pool full),
        the transfer waited for a plan: receive it into the blocks as the default path does."""
        import asyncio

        kv, bs = self.bg.kv, self.buffer_set_id
        if job.why_not:
            with contextlib.suppress(Exception):
                await kv.abort(job.transfer_id, job.why_not)
            raise RuntimeError(f"landed KV not claimable: {job.why_not}")
        try:
            if landing is not None:
                await asyncio.wrap_future(landing)
        except Exception as exc:  # refused at once: no landing; the sender waits for a plan
            log.info("kvservice: landing of %s refused (%s); receiving directly", job.transfer_id, exc)
            return await asyncio.wrap_future(
                self.bg.transfer(
                    job.transfer_id,
                    lambda c: c.expect_delta(
                        job.transfer_id,
                        bs,
                        prefix_pages=job.prefix_pages,
                        dst_page_indices=job.pages,
                        deadline_ms=job.deadline_ms,
                        sender_address=job.sender,
                    ),
                    job.deadline_ms,
                )
            )
        return (
            await kv.claim(job.transfer_id, bs, dst_page_indices=job.pages, wait_ms=job.deadline_ms)
        ).status

    def _finish(self, job: SendJob | RecvJob | ClaimJob, fut: Any) -> None:
        """Report a job's outcome; a load that was aborted only once the abort has settled."""
        if tracing() and fut.exception() is None:
            st = fut.result()
            trace("done", job.transfer_id, state=st.state, path=st.path, timings_us=st.timings_us)
        if isinstance(job, RecvJob):
            self._layerwise.discard(job.transfer_id)
        abort = self._aborts.pop(job.transfer_id, None) if isinstance(job, RecvJob | ClaimJob) else None
        if abort is not None and not abort.done():
            abort.add_done_callback(lambda _: self._outcomes.put(_outcome(job, fut)))
        else:
            self._outcomes.put(_outcome(job, fut))

    def outcomes(self) -> list[Outcome]:
        out: list[Outcome] = []
        while True:
            try:
                out.append(self._outcomes.get_nowait())
                trace("picked", out[-1].job.transfer_id)
            except queue.Empty:
                return out

    def close(self) -> None:
        flush_trace()
        self.bg.close()
        for shm in self._shm:
            with contextlib.suppress(Exception):
                shm.close()
            with contextlib.suppress(Exception):
                shm.unlink()


async def _register_layers(
    bg: BackgroundClient, one: Layout, k: list[Region], v: list[Region], engine_id: str, ids: list[int]
) -> list[str]:
    """One buffer set per layer over the whole-cache set's memory (layer-wise transfers), its
    engine id ``<engine>#L<the model's layer number>``."""
    import asyncio

    sets = await asyncio.gather(
        *(
            bg.kv.register_buffers(one, [k[i]], [v[i]] if v else [], engine_id=f"{engine_id}#L{n}")
            for i, n in enumerate(ids)
        )
    )
    return [s.buffer_set_id for s in sets]


async def _land(bg: BackgroundClient, bs: str, job: LandJob) -> Any:
    return await bg.kv.expect_landing(
        job.transfer_id,
        bs,
        prefix_pages=job.prefix_pages,
        pages=job.pages,
        ttl_ms=job.ttl_ms,
        deadline_ms=job.deadline_ms,
        sender_address=job.sender,
    )


async def _abort(bg: BackgroundClient, job: AbortJob, landing: Any = None) -> None:
    import asyncio

    if landing is not None:  # the landing's declaration first, so the abort finds it
        with contextlib.suppress(Exception):
            await asyncio.wrap_future(landing)
    try:
        await bg.kv.abort(job.transfer_id, job.reason)
    except NotFound:  # it had ended already
        pass
    except Exception as exc:  # the load's own outcome still reports the request
        log.warning("kvservice: abort of %s failed: %s", job.transfer_id, exc)


def _outcome(job: SendJob | RecvJob | ClaimJob, fut: Any) -> Outcome:
    exc = fut.exception()
    if exc is not None:
        return Outcome(job, False, f"{type(exc).__name__}: {exc}")
    st = fut.result()
    return Outcome(job, st.state == "DONE", st.error)
