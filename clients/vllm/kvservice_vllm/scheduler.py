"""Scheduler side: bookkeeping only (dict operations; no RPC on the scheduler's thread).

Prefill instance (``do_remote_decode``)::

    request_finished ─▶ SendJob (blocks held) ─▶ worker: SendDelta ─▶ finished_sending ─▶ blocks freed

Decode instance (``do_remote_prefill``, the params the prefill returned)::

    get_num_new_matched_tokens: prompt - local prefix hit, async
    update_state_after_alloc ─▶ RecvJob(prefix_pages = local hit, the rest of the blocks)
    worker: ExpectDelta ─▶ finished_recving (failed_recving + load-error blocks if it failed)
    request_finished while still loading ─▶ AbortJob; the load is reported finished once it settled
"""

from __future__ import annotations

import secrets
from typing import Any

from .meta import AbortJob, KVServiceMeta, RecvJob, SendJob
from .sched_timer import trace

__all__ = ["SchedulerSide"]


def _first_group(block_ids: Any) -> list[int]:
    """vLLM passes one list per KV-cache group (a tuple) or, for one group, a plain list."""
    if isinstance(block_ids, tuple):
        return list(block_ids[0]) if block_ids else []
    return list(block_ids)


class SchedulerSide:
    def __init__(self, block_size: int, deadline_ms: int) -> None:
        self.block_size = block_size
        self.deadline_ms = deadline_ms
        self._meta = KVServiceMeta()
        self.sending: set[str] = set()  # prefill: requests whose blocks we hold until their send ends
        self.receiving: dict[str, RecvJob] = {}  # decode: loads not yet reported finished
        self._local_hit: dict[str, int] = {}  # decode: the local prefix hit seen at matching

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- decode ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or request.request_id in self.receiving:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hit[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        params["do_remote_prefill"] = False  # the load is planned once
        local = self._local_hit.pop(request.request_id, 0)
        prefix = local // self.block_size
        ids = _first_group(blocks.get_block_ids())
        job = RecvJob(
            req_id=request.request_id,
            transfer_id=str(params["transfer_id"]),
            prefix_pages=prefix,
            pages=tuple(ids[prefix : self._pages(len(request.prompt_token_ids or ()))]),
            deadline_ms=int(params.get("deadline_ms", self.deadline_ms)),
        )
        self.receiving[job.req_id] = job
        self._meta.recvs.append(job)
        trace("recv_job", job.transfer_id)

    # -- prefill -----------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._local_hit.pop(rid, None)
        recv = self.receiving.get(rid)
        if recv is not None:
            # decode: ended while loading (aborted, or failed by vLLM for this very load). vLLM
            # holds the blocks of a request waiting for remote KV until its load is reported
            # finished; the worker reports it only once the abort has settled (no write after).
            why = "the request ended while its KV was loading"
            self._meta.aborts.append(AbortJob(rid, recv.transfer_id, why))
            return False, None
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or not _capped(request):
            return False, None
        transfer_id = str(params.get("transfer_id") or f"vllm-{secrets.token_hex(8)}")
        peer = params.get("kvservice_peer")
        if not peer:  # nothing to send to; the caller learns why from the response's params
            return False, {
                "do_remote_prefill": False,
                "kvservice_error": "kv_transfer_params.kvservice_peer is missing: give the decode "
                "instance's kvservice address (host:port) with do_remote_decode",
            }
        deadline = int(params.get("deadline_ms", self.deadline_ms))
        pages = _first_group(block_ids)[: self._pages(len(request.prompt_token_ids or ()))]
        self._meta.sends.append(SendJob(rid, transfer_id, tuple(pages), str(peer), deadline))
        self.sending.add(rid)
        trace("send_job", transfer_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "deadline_ms": deadline,
        }

    # -- every step --------------------------------------------------------------------------
    def build_connector_meta(self) -> KVServiceMeta:
        meta, self._meta = self._meta, KVServiceMeta()
        return meta

    def finished(self, sending: set[str] | None, recving: set[str] | None) -> None:
        for rid in sending or ():
            self.sending.discard(rid)
        for rid in recving or ():
            job = self.receiving.pop(rid, None)
            if job is not None:
                trace("recv_finished", job.transfer_id)

    def has_pending_push_work(self) -> bool:
        return bool(self.sending)


def _capped(request: Any) -> bool:
    """The prefill ran to its max_tokens (its KV is whole); an aborted or failed one sends nothing."""
    from vllm.v1.request import RequestStatus

    return bool(request.status == RequestStatus.FINISHED_LENGTH_CAPPED)
