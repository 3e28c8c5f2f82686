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

Layer-wise streaming, for the requests whose params ask for it (``kvservice_layerwise: true``):
a proxy that sends the decode request at once, beside the prefill's, sets it on both (then the
decode declares its loads while the prefill computes, which is when streaming hides the
transfer; with the decode request sent after the prefill's answer nothing would be hidden, and
a receiver of another engine declares one transfer). ``layer_streaming: false`` turns it off on
an instance. The prefill's answer says what it did; the decode follows its params (no field:
one transfer, as older prefills send)::

    prefill: update_state_after_alloc ─▶ a stream (transfer id, peer, its blocks)
             build_connector_meta, each step it computes ─▶ StreamChunk: the pages this step
                 completes; the worker sends them layer by layer (layers.py); the prompt's
                 last step's chunk is the last
             request_finished ─▶ StreamEnd (whole, or "abort: it ended early"); blocks held
    decode:  RecvJob(layerwise) ─▶ one ExpectDelta per layer (same prefix and blocks)
A streamed request that vLLM preempts (its blocks freed) is aborted: its decode fails that load.

Pipeline parallelism: an instance with PP > 1 sends and loads one transfer per layer always (each
stage its own layers, layers.py); its prefill's answer says so, and a decode with PP > 1 loads
layer by layer whatever its params say, so its prefill must be sent ``kvservice_layerwise: true``
when the prefill itself is PP 1 (the proxy knows both; without it the load fails at its deadline).

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

from .meta import AbortJob, ClaimJob, KVServiceMeta, LandJob, RecvJob, SendJob, StreamChunk, StreamEnd
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


class _Stream:
    """A prefill request being streamed layer by layer (scheduler-side bookkeeping)."""

    __slots__ = ("blocks", "broken", "deadline_ms", "last_sent", "peer", "request", "sent", "transfer_id")

    def __init__(self, request: Any, transfer_id: str, peer: str, deadline_ms: int) -> None:
        self.request, self.transfer_id, self.peer, self.deadline_ms = request, transfer_id, peer, deadline_ms
        self.blocks: list[int] = []  # its block ids, as vLLM allocated them (scheduler output)
        self.sent = 0  # pages handed to the worker so far
        self.last_sent = False
        self.broken = ""  # why it cannot complete (preempted): aborted when it finishes


class SchedulerSide:
    def __init__(
        self,
        block_size: int,
        deadline_ms: int,
        landing_ttl_ms: int = 0,
        peer_address: str = "",
        service_address: str = "",
        layer_streaming: bool = True,
        pipeline_parallel: int = 1,
    ) -> None:
        self.block_size = block_size
        self.layer_streaming = layer_streaming
        # PP > 1: a stage holds some layers, so every transfer goes one per layer (layers.py)
        self.pipeline_parallel = pipeline_parallel
        self._streams: dict[str, _Stream] = {}  # prefill: requests streamed layer by layer
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
        if self.landing_ttl_ms and request.request_id not in self.landed and not _loads_layerwise(params):
            self._unallocated[request.request_id] = request
        return count, True

    def _layerwise(self, params: dict[str, Any]) -> bool:
        """Prefill: whether to stream this request: it asks (``kvservice_layerwise``: the proxy
        starts the decode request at once, so the decode declares before the prefill ends: the
        only case where streaming hides anything) and the instance allows it."""
        return self.layer_streaming and bool(params.get("kvservice_layerwise", False))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._stream_start(request, params)
            return
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
            layerwise=_loads_layerwise(params) or self.pipeline_parallel > 1,
        )
        self.receiving[job.req_id] = job
        self._meta.recvs.append(job)
        trace("recv_job", job.transfer_id)

    # -- prefill -----------------------------------------------------------------------------
    def _stream_start(self, request: Any, params: dict[str, Any]) -> None:
        """A do_remote_decode request was allocated: stream it if it should be (a resumed one,
        preempted meanwhile, cannot be: its earlier chunks named blocks it no longer holds)."""
        rid = request.request_id
        old = self._streams.get(rid)
        if old is not None:
            old.broken = old.broken or "vLLM preempted the request mid-stream (its blocks were freed)"
            return
        peer = params.get("kvservice_peer")
        if not self._layerwise(params) or not peer:
            return
        params["transfer_id"] = str(params.get("transfer_id") or f"vllm-{secrets.token_hex(8)}")
        self._streams[rid] = _Stream(
            request, params["transfer_id"], str(peer), int(params.get("deadline_ms", self.deadline_ms))
        )

    def _stream_step(self, scheduler_output: Any) -> None:
        """The pages each streamed request completes in this step, as StreamChunks.

        ``num_computed`` is the request's count before this step (vLLM advances it after
        build_connector_meta); ``done`` = num_computed + scheduled::

            pages  [0 ........ sent)[sent ........ end)[end ...
                    sent earlier     this step's chunk   not computed yet
            end = done // block_size, or every prompt page when done reaches the prompt (last)
        """
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._streams.get(new.req_id)
            if st is not None:
                st.blocks = list(_first_group(new.block_ids))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._streams.get(rid)
            if st is None:
                continue
            if rid in cached.resumed_req_ids:
                st.broken = st.broken or "vLLM preempted the request mid-stream (its blocks were freed)"
            elif cached.new_block_ids[i] is not None:
                st.blocks.extend(_first_group(cached.new_block_ids[i]))
        for rid, st in self._streams.items():
            if st.last_sent or st.broken or rid not in sched:
                continue
            prompt = len(st.request.prompt_token_ids or ())
            done = int(st.request.num_computed_tokens) + int(sched[rid])
            last = done >= prompt
            end = self._pages(prompt) if last else done // self.block_size
            if end > len(st.blocks):  # never name a block vLLM has not given it
                st.broken = f"its blocks ({len(st.blocks)}) do not cover page {end}"
                continue
            if end <= st.sent and not last:
                continue
            self._meta.chunks.append(
                StreamChunk(rid, st.transfer_id, st.sent, tuple(st.blocks[st.sent : end]), last, st.peer,
                            st.deadline_ms)
            )  # fmt: skip
            st.sent, st.last_sent = end, last

    def _stream_finished(self, request: Any, st: _Stream) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        whole = st.last_sent and not st.broken and _capped(request)
        why = "" if whole else (st.broken or "the request ended before its prompt was computed")
        self._meta.stream_ends.append(StreamEnd(rid, st.transfer_id, why))
        self.sending.add(rid)  # its blocks are held until every layer transfer ended
        trace("stream_end", st.transfer_id)
        if not whole:
            return True, None
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": st.transfer_id,
            "deadline_ms": st.deadline_ms,
            "kvservice_layerwise": True,
        }
        if self.peer_address:
            out["kvservice_sender"] = self.peer_address
        return True, out

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        stream = self._streams.pop(rid, None)
        if stream is not None:
            return self._stream_finished(request, stream)
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
        layerwise = self.pipeline_parallel > 1 or bool(params.get("kvservice_layerwise", False))
        self._meta.sends.append(SendJob(rid, transfer_id, tuple(pages), str(peer), deadline, layerwise))
        self.sending.add(rid)
        trace("send_job", transfer_id)
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "deadline_ms": deadline,
            "kvservice_layerwise": layerwise,
        }
        if self.peer_address:  # the decode names it in ExpectDelta: no other peer fetches the plan
            out["kvservice_sender"] = self.peer_address
        return True, out

    # -- every step --------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any = None) -> KVServiceMeta:
        if self._streams and scheduler_output is not None:
            self._stream_step(scheduler_output)
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


def _loads_layerwise(params: dict[str, Any]) -> bool:
    """Decode: whether the prefill streams this request layer by layer, as its answer (or the
    proxy) says; params without the field come from a prefill that sends one transfer."""
    return bool(params.get("kvservice_layerwise", False))


def _sender(params: dict[str, Any]) -> str:
    """The prefill's kvservice as its answer named it (``kvservice_sender``); "" when it did not."""
    sender = params.get("kvservice_sender")
    return sender if isinstance(sender, str) else ""


def _capped(request: Any) -> bool:
    """The prefill ran to its max_tokens (its KV is whole); an aborted or failed one sends nothing."""
    from vllm.v1.request import RequestStatus

    return bool(request.status == RequestStatus.FINISHED_LENGTH_CAPPED)
