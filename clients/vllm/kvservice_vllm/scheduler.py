"""Scheduler side: bookkeeping only (dict operations; no RPC on the scheduler's thread).

Prefill instance (``do_remote_decode``)::

    request_finished ─▶ SendJob (blocks held) ─▶ worker: SendDelta ─▶ finished_sending ─▶ blocks freed

Decode instance (``do_remote_prefill``, the params the prefill returned)::

    get_num_new_matched_tokens: prompt - local prefix hit, async
    update_state_after_alloc ─▶ RecvJob(prefix_pages = local hit, the rest of the blocks)
    worker: ExpectDelta ─▶ finished_recving (failed_recving + load-error blocks if it failed)
    request_finished while still loading ─▶ AbortJob; the load is reported finished once it settled

Decode instance with the landing option (``landing_ttl_ms`` > 0), when vLLM could not allocate the
request's blocks in the step that matched it (its pre-allocation would wait)::

    get_num_new_matched_tokens, no update_state_after_alloc this step ─▶ LandJob: ExpectDelta
        (landing): the prefill sends now, its pages free at LANDED, no block of ours is held
    update_state_after_alloc (later) ─▶ ClaimJob: Claim into the blocks ─▶ finished_recving
    request_finished before its blocks came ─▶ AbortJob (the landing is freed)
A request allocated in the step that matched it takes the default path (RecvJob) unchanged.

The prefill's answer names its own kvservice (``kvservice_sender``), and the decode's loads pass it
on as ExpectDelta's ``sender_address``, so only that service may fetch the transfer's plan (issue
33; docs/design/security.md). It is the ``kvservice_peer_address`` the prefill is configured with, else
what its kvservice tells its sessions (``Client.service_peer_address``), asked once on a
background thread at start; until that answer comes (or when nothing answers) the params carry
none and the loads name no sender, as before.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from .meta import AbortJob, ClaimJob, KVServiceMeta, LandJob, RecvJob, SendJob
from .sched_timer import trace

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)
_LOOKUP_TIMEOUT_S = 10.0  # one try to open a session with the local service
_LOOKUP_BACKOFF_S = (1.0, 30.0)  # between tries: first, most


def _first_group(block_ids: Any) -> list[int]:
    """vLLM passes one list per KV-cache group (a tuple) or, for one group, a plain list."""
    if isinstance(block_ids, tuple):
        return list(block_ids[0]) if block_ids else []
    return list(block_ids)


class SchedulerSide:
    def __init__(
        self,
        block_size: int,
        deadline_ms: int,
        landing_ttl_ms: int = 0,
        peer_address: str = "",
        service_address: str = "",
    ) -> None:
        self.block_size = block_size
        self.deadline_ms = deadline_ms
        self.landing_ttl_ms = landing_ttl_ms  # 0: no landing (the default path only)
        self.peer_address = peer_address  # prefill: this instance's kvservice as peers reach it
        # set once peer_address is final: configured, or asked of ``service_address`` (the local
        # kvservice) on a background thread, never on the scheduler's
        self.peer_address_known = threading.Event()
        if peer_address or not service_address:
            self.peer_address_known.set()
        else:
            threading.Thread(
                target=self._ask_peer_address,
                args=(service_address,),
                name="kvservice-peer-address",
                daemon=True,
            ).start()
        self._unallocated: dict[str, Any] = {}  # matched this step, no blocks yet (landing option)
        self.landed: dict[str, LandJob] = {}  # decode: landings declared, not yet claimed
        self._meta = KVServiceMeta()
        self.sending: set[str] = set()  # prefill: requests whose blocks we hold until their send ends
        self.receiving: dict[str, RecvJob | ClaimJob] = {}  # decode: loads not yet reported finished
        self._local_hit: dict[str, int] = {}  # decode: the local prefix hit seen at matching

    def _ask_peer_address(self, service_address: str) -> None:
        """``peer_address`` from the local kvservice (what it tells each session), tried until it
        answers; "" stays when it is too old to say."""
        from kvservice_client import KVClientError, ask_service_peer_address

        pause = _LOOKUP_BACKOFF_S[0]
        while True:
            try:
                self.peer_address = ask_service_peer_address(
                    service_address, "vllm-scheduler", _LOOKUP_TIMEOUT_S
                )
                break
            except (KVClientError, OSError, ValueError) as exc:
                log.info("kvservice: no peer address from %s yet (%s); retrying", service_address, exc)
                time.sleep(pause)
                pause = min(pause * 2, _LOOKUP_BACKOFF_S[1])
        log.info("kvservice: this prefill names its kvservice as %r", self.peer_address)
        self.peer_address_known.set()

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
        if self.landing_ttl_ms and request.request_id not in self.landed:
            self._unallocated[request.request_id] = request
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        params["do_remote_prefill"] = False  # the load is planned once
        self._unallocated.pop(request.request_id, None)
        local = self._local_hit.pop(request.request_id, 0)
        prefix = local // self.block_size
        ids = _first_group(blocks.get_block_ids())
        land = self.landed.pop(request.request_id, None)
        if land is not None:  # its pages landed meanwhile: claim them into these blocks
            end = land.prefix_pages + land.pages
            why = ""
            if prefix < land.prefix_pages or len(ids) < end:  # pages nobody would fill
                why = (
                    f"local prefix hit now {prefix} pages, {len(ids)} blocks; landed past {land.prefix_pages}"
                )
            claim = ClaimJob(
                request.request_id, land.transfer_id, land.prefix_pages, tuple(ids[land.prefix_pages : end]),
                land.deadline_ms, why, land.sender,
            )  # fmt: skip
            self.receiving[claim.req_id] = claim
            self._meta.claims.append(claim)
            return
        job = RecvJob(
            req_id=request.request_id,
            transfer_id=str(params["transfer_id"]),
            prefix_pages=prefix,
            pages=tuple(ids[prefix : self._pages(len(request.prompt_token_ids or ()))]),
            deadline_ms=int(params.get("deadline_ms", self.deadline_ms)),
            sender=_sender(params),
        )
        self.receiving[job.req_id] = job
        self._meta.recvs.append(job)
        trace("recv_job", job.transfer_id)

    # -- prefill -----------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._local_hit.pop(rid, None)
        self._unallocated.pop(rid, None)
        land = self.landed.pop(rid, None)
        if land is not None:  # landed, never allocated: free the landing (no block of ours to hold)
            self._meta.aborts.append(
                AbortJob(rid, land.transfer_id, "the request ended before it claimed its KV")
            )
            return False, None
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
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "deadline_ms": deadline,
        }
        if self.peer_address:  # the decode names it in ExpectDelta: no other peer fetches the plan
            out["kvservice_sender"] = self.peer_address
        return True, out

    # -- every step --------------------------------------------------------------------------
    def build_connector_meta(self) -> KVServiceMeta:
        for rid, request in self._unallocated.items():  # could not allocate at once: land it
            params = request.kv_transfer_params
            local = self._local_hit.get(rid, 0) // self.block_size
            job = LandJob(
                rid,
                str(params["transfer_id"]),
                local,
                self._pages(len(request.prompt_token_ids or ())) - local,
                int(params.get("deadline_ms", self.deadline_ms)),
                self.landing_ttl_ms,
                _sender(params),
            )
            self.landed[rid] = job
            self._meta.lands.append(job)
        self._unallocated.clear()
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


def _sender(params: dict[str, Any]) -> str:
    """The prefill's kvservice as its answer named it (``kvservice_sender``); "" when it did not."""
    sender = params.get("kvservice_sender")
    return sender if isinstance(sender, str) else ""


def _capped(request: Any) -> bool:
    """The prefill ran to its max_tokens (its KV is whole); an aborted or failed one sends nothing."""
    from vllm.v1.request import RequestStatus

    return bool(request.status == RequestStatus.FINISHED_LENGTH_CAPPED)
