"""``KVServiceConnector``: vLLM's KVConnectorBase_V1 on kvservice (see scheduler.py, worker.py).

kv_connector_extra_config:
    kvservice_address  the local service (default ``unix:/tmp/kvservice-<uid>.sock``)
    deadline_ms        a transfer's deadline when the request's params give none (default 30000)
    rpc_timeout_s      one call to the service, retries across a broken connection included (10)
    landing_ttl_ms     decode: a request vLLM cannot allocate at once lands meanwhile (0: off)
    layer_streaming    prefill: a request whose params ask (``kvservice_layerwise: true``) sends
                       each layer's pages as soon as the layer is computed (one transfer per
                       layer, layers.py); false: never. Default true
    kvservice_peer_address  prefill: this instance's kvservice as other services reach it (its
                       peer address); returned as ``kvservice_sender``, the decode names it in
                       ExpectDelta so only that service may fetch the plan. Default (""): what
                       the local kvservice says it is (``Client.service_peer_address``); set it
                       where peers reach the service at another address (NAT)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .meta import KVServiceMeta, SendJob
from .sched_timer import SchedulerTimer, maybe_time, trace, tracing
from .scheduler import SchedulerSide

if TYPE_CHECKING:
    import torch

    from .worker import KVHeads, WorkerSide

__all__ = ["KVServiceConnector"]


def _flag(value: Any) -> bool:
    """A boolean extra_config value (JSON true/false, or a string such as "0" / "off")."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "off", "no")
    return bool(value)


class KVServiceConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config
        self.block_size = int(vllm_config.cache_config.block_size)
        deadline_ms = int(extra.get_from_extra_config("deadline_ms", 30_000))
        self.address = str(
            extra.get_from_extra_config("kvservice_address", f"unix:/tmp/kvservice-{os.getuid()}.sock")
        )
        self.engine_id = str(extra.engine_id or "vllm")
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._errors: set[int] = set()
        self._timer: SchedulerTimer | None = None
        if role == KVConnectorRole.SCHEDULER:
            # landing_ttl_ms > 0: a decode request vLLM cannot allocate at once lands meanwhile
            landing_ttl_ms = int(extra.get_from_extra_config("landing_ttl_ms", 0))
            peer_address = str(extra.get_from_extra_config("kvservice_peer_address", "") or "")
            self._sched = SchedulerSide(
                self.block_size, deadline_ms, landing_ttl_ms, peer_address, self.address,
                layer_streaming=_flag(extra.get_from_extra_config("layer_streaming", True)),
                pipeline_parallel=int(vllm_config.parallel_config.pipeline_parallel_size),
            )  # fmt: skip
            self._timer = maybe_time(self)  # opt-in (KVSERVICE_VLLM_SCHED_TIMES); else no wrapper
        else:
            from .worker import WorkerSide

            timeout = float(extra.get_from_extra_config("rpc_timeout_s", 10.0))
            self._worker = WorkerSide(self.address, f"vllm-{self.engine_id}", self.engine_id, timeout)

    # -- worker ------------------------------------------------------------------------------
    def _w(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side method was called on the scheduler side"
        return self._worker

    def get_mem_pool_context(self) -> Any:
        device = self._vllm_config.device_config.device
        return self._w().allocation_context() if getattr(device, "type", str(device)) == "cpu" else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        device = self._vllm_config.device_config.device
        cpu = getattr(device, "type", str(device)) == "cpu"  # vLLM's CPU attention backend reads it
        self._w().register(kv_caches, self.block_size, self._heads(), cpu_attention=cpu, mla_tp=self._tp())

    def _tp(self) -> tuple[int, int]:
        """(TP size, this worker's TP rank)."""
        size = int(self._vllm_config.parallel_config.tensor_parallel_size)
        if size == 1:
            return 1, 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return size, int(get_tensor_model_parallel_rank())

    def _heads(self) -> KVHeads | None:
        """This rank's KV heads (None for MLA: the latent cache moves as opaque blocks, a replica
        on every TP rank)."""
        from .worker import KVHeads

        mc, pc = self._vllm_config.model_config, self._vllm_config.parallel_config
        if mc.use_mla:
            return None
        size, rank = self._tp()
        return KVHeads(
            total=mc.get_total_num_kv_heads(),
            local=mc.get_num_kv_heads(pc),
            head_dim=mc.get_head_size(),
            tp_size=size,
            tp_rank=rank,
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVServiceMeta)
        self._w().submit(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request's KV lands before it is scheduled (async load): nothing per layer

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Layer-wise streaming: this layer's pages of the step's streamed requests go now."""
        if tracing():
            trace("layer_saved", "")  # this layer is computed (bench: the transfer tail after the last)
        meta = self._get_connector_metadata()
        if meta.chunks:  # type: ignore[attr-defined]
            self._w().save_layer(layer_name, meta)  # type: ignore[arg-type]

    def wait_for_save(self) -> None:
        """The step's layers no save_kv_layer came for (none, as vLLM calls it for every
        attention layer) go now, so each stream's chunk of this step is whole."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if meta.chunks:  # type: ignore[attr-defined]
                self._w().end_step(meta)  # type: ignore[arg-type]

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults()
        for o in self._w().outcomes():
            if isinstance(o.job, SendJob):  # blocks the scheduler held may go now
                res.finished_sending.add(o.job.req_id)
            else:
                res.finished_recving.add(o.job.req_id)
                if not o.ok:  # never let vLLM treat what did not arrive as valid KV
                    res.failed_recving.add(o.job.req_id)
                    self._errors.update(o.job.pages)
        return res

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._timer is not None:
            self._timer.write()

    # -- scheduler ---------------------------------------------------------------------------
    def _s(self) -> SchedulerSide:
        assert self._sched is not None, "a scheduler-side method was called on a worker"
        return self._sched

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._s().finished(connector_output.finished_sending, connector_output.finished_recving)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._s().has_pending_push_work()
