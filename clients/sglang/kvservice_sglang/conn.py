"""SGLang's BaseKVManager / BaseKVSender / BaseKVReceiver / BaseKVBootstrapServer on kvservice: the
facade SGLang's ``get_kv_class`` hands out (``plugin``); each role is a module of its own
(``manager``, ``sender``, ``receiver``, ``bootstrap``; ``room``: what a room's two sides share).

One request (``bootstrap_room``) is one kvservice transfer, ``sgl-<room>``::

    decode  Receiver.init ─▶ send_metadata(kv_indices, aux_index, decode_prefix_len)
              ├─ ExpectDelta(dst = kv_indices: the pages past decode_prefix_len, aux row)
              └─ PUT /room/<room> {peer: its kvservice, decode_prefix_len} ─▶ prefill's bootstrap server
    prefill Sender.poll: Bootstrapping until the room is there, then WaitingForInput
              pop_decode_prefix_len ─▶ init(num_pages, aux_index) ─▶ send(pages) per chunk
              └─ SendDelta(chunk_offset = prefix pages + pages sent so far, the last chunk
                 carries the aux row)
    both    poll: Transferring ─▶ Success (DONE) or Failed (FAILED / ABORTED, with the reason)

Landing option (decode, ``SGLANG_KVSERVICE_LANDING_TTL_MS`` > 0), so the prefill need not wait for
the decode's allocation (seed 002's pre-allocation queue)::

    decode  Receiver.init ─▶ PUT /room/<room> {peer, decode_prefix_len 0, landing}: the prefill starts
    prefill init(num_pages) ─▶ PUT /room/<room>/pages {pages}; send(pages): SendDelta as usual
    decode  GET /room/<room>/pages ─▶ ExpectDelta(landing: pages, one aux row per aux buffer),
              unless send_metadata came first; the prefill's pages are free at LANDED
            send_metadata(kv_indices, aux_index) ─▶ Claim(kv_indices, aux row) ─▶ Success
              (no landing, or refused because the pool is full: ExpectDelta, as without the option)

The decode names the prefill's kvservice as the sender (ExpectDelta's ``sender_address``;
docs/design/security.md) so no other peer can fetch the plan first: the prefill's bootstrap
server answers ``GET /service`` with its ``SGLANG_KVSERVICE_PEER_ADDRESS``, else with what its
kvservice tells its sessions
(``Client.service_peer_address``, asked once; 404 while the service cannot be reached: then no
sender is named, as before), which the decode reads once a minute per bootstrap server, when a
receiver is made.

Every attention TP rank of the prefill runs a sender of the room and reads the decode's post
(``GET /room/<room>?rank=<r>&ranks=<n>``: the entry goes once all ``n`` read it, or at its TTL);
each registered as its attention TP rank, so the service splits heads between ranks, or (MLA, a
replica on every rank) serves each decode rank from one prefill rank and ends the others with
nothing moved.

Only the delta moves: SGLang's prefill sends from the decode's prefix on (seed 000's
``decode_prefix_len``, which the prefill learns from the room), so the transfer is exactly the
pages past it. Positions are absolute (the receiver declares ``decode_prefix_len`` as its prefix,
the sender counts from there), so the other side may be any engine: a vLLM receiver whose room
was posted with ``decode_prefix_len`` 0 gets every page past its own prefix-cache hit (the service
skips the rest), in its own block size and page layout. Every RPC runs on the manager's
:class:`BackgroundClient` thread; the scheduler's calls only look at futures.
"""

from __future__ import annotations

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)

from .bootstrap import KVServiceBootstrapServer, http_json
from .manager import KVServiceManager
from .receiver import KVServiceReceiver
from .room import KVServiceTransferError, transfer_id
from .sender import KVServiceSender

_http = http_json  # the rendezvous' HTTP call, as the tests drive the bootstrap server

__all__ = [
    "BaseKVBootstrapServer",
    "BaseKVManager",
    "BaseKVReceiver",
    "BaseKVSender",
    "KVArgs",
    "KVPoll",
    "KVServiceBootstrapServer",
    "KVServiceManager",
    "KVServiceReceiver",
    "KVServiceSender",
    "KVServiceTransferError",
    "KVTransferMetric",
    "transfer_id",
]
