"""The connector's scheduler side with real vLLM Request objects (run in .venv-vllm)."""

from __future__ import annotations

import pytest
from kvservice_vllm.meta import AbortJob, ClaimJob, LandJob, RecvJob, SendJob, StreamChunk, StreamEnd
from kvservice_vllm.scheduler import SchedulerSide
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

BLOCK = 32


def _req(rid: str, n: int, params: dict | None) -> Request:
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, list(range(n)), sp, None)


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def test_prefill_sends_the_prompt_pages_and_holds_the_blocks_until_the_send_ends() -> None:
    s = SchedulerSide(BLOCK, 30_000)
    r = _req("p-1", 70, {"do_remote_decode": True, "kvservice_peer": "10.0.0.2:50051", "transfer_id": "t"})
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = s.request_finished(r, [7, 8, 9, 10])  # a 4th block holds the sampled token
    assert hold and params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "t",
        "deadline_ms": 30_000,
        "kvservice_layerwise": False,  # sent whole: the decode declares one transfer
    }
    meta = s.build_connector_meta()
    assert meta.sends == [SendJob("p-1", "t", (7, 8, 9), "10.0.0.2:50051", 30_000)]
    assert s.build_connector_meta().sends == []  # handed over once
    assert s.has_pending_push_work()
    s.finished({"p-1"}, None)
    assert not s.has_pending_push_work()


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
def test_a_prefill_that_did_not_run_to_its_length_sends_nothing(status) -> None:
    s = SchedulerSide(BLOCK, 30_000)
    r = _req("p-2", 40, {"do_remote_decode": True, "kvservice_peer": "h:1"})
    r.status = status
    assert s.request_finished(r, [1, 2]) == (False, None)
    assert s.build_connector_meta().sends == [] and not s.has_pending_push_work()


def test_a_prefill_without_a_peer_says_why_and_sends_nothing() -> None:
    s = SchedulerSide(BLOCK, 30_000)
    r = _req("p-3", 40, {"do_remote_decode": True})
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = s.request_finished(r, [1, 2])
    assert not hold and "kvservice_peer" in params["kvservice_error"]
    assert s.build_connector_meta().sends == []


def test_decode_loads_only_past_its_prefix_hit_once() -> None:
    s = SchedulerSide(BLOCK, 30_000)
    r = _req("d-1", 150, {"do_remote_prefill": True, "transfer_id": "t", "deadline_ms": 5000})
    assert s.get_num_new_matched_tokens(r, 64) == (86, True)
    s.update_state_after_alloc(r, _Blocks([4, 5, 11, 12, 13]), 86)
    meta = s.build_connector_meta()
    assert meta.recvs == [RecvJob("d-1", "t", 2, (11, 12, 13), 5000)]
    assert s.get_num_new_matched_tokens(r, 64) == (0, False)  # planned once
    s.update_state_after_alloc(r, _Blocks([4, 5, 11, 12, 13, 14]), 0)  # the later allocation
    assert s.build_connector_meta().recvs == []
    s.finished(None, {"d-1"})
    assert not s.receiving


def test_a_decode_request_ending_mid_load_aborts_before_its_blocks_go() -> None:
    s = SchedulerSide(BLOCK, 30_000)
    r = _req("d-2", 40, {"do_remote_prefill": True, "transfer_id": "t2"})
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks([1, 2]), 40)
    s.build_connector_meta()
    # vLLM holds the blocks of a request waiting for remote KV; the worker reports the load
    # finished once the abort has settled
    assert s.request_finished(r, [1, 2]) == (False, None)
    aborts = s.build_connector_meta().aborts
    assert aborts == [AbortJob("d-2", "t2", "the request ended while its KV was loading")]
    s.finished(None, {"d-2"})
    assert not s.receiving


def test_plain_requests_pass_through() -> None:
    s = SchedulerSide(BLOCK, 30_000)
    r = _req("x", 40, None)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, _Blocks([1, 2]), 0)
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(r, [1, 2]) == (False, None)
    meta = s.build_connector_meta()
    assert not (meta.sends or meta.recvs or meta.aborts)


def test_landing_option_lands_what_vllm_could_not_allocate_and_claims_it_later() -> None:
    """landing_ttl_ms: matched but not allocated this step -> LandJob; allocated later -> ClaimJob."""
    s = SchedulerSide(BLOCK, 30_000, landing_ttl_ms=4000)
    r = _req("d-3", 150, {"do_remote_prefill": True, "transfer_id": "t3", "deadline_ms": 5000})
    assert s.get_num_new_matched_tokens(r, 64) == (86, True)  # no room: no update_state_after_alloc
    meta = s.build_connector_meta()
    assert meta.lands == [LandJob("d-3", "t3", 2, 3, 5000, 4000)] and meta.recvs == []
    assert s.get_num_new_matched_tokens(r, 64) == (86, True)  # asked again in a later step
    assert s.build_connector_meta().lands == []  # landed once
    s.update_state_after_alloc(r, _Blocks([4, 5, 11, 12, 13]), 86)
    meta = s.build_connector_meta()
    assert meta.claims == [ClaimJob("d-3", "t3", 2, (11, 12, 13), 5000)] and meta.recvs == []
    s.finished(None, {"d-3"})
    assert not s.receiving and not s.landed


def test_landing_option_keeps_the_default_path_when_vllm_allocates_at_once() -> None:
    """Allocated in the step that matched it: a plain RecvJob, no landing."""
    s = SchedulerSide(BLOCK, 30_000, landing_ttl_ms=4000)
    r = _req("d-4", 150, {"do_remote_prefill": True, "transfer_id": "t4", "deadline_ms": 5000})
    s.get_num_new_matched_tokens(r, 64)
    s.update_state_after_alloc(r, _Blocks([4, 5, 11, 12, 13]), 86)
    meta = s.build_connector_meta()
    assert (
        meta.recvs == [RecvJob("d-4", "t4", 2, (11, 12, 13), 5000)] and meta.lands == [] and meta.claims == []
    )


def test_landing_option_a_request_ending_before_its_blocks_frees_the_landing() -> None:
    """Landed, never allocated, then finished: an AbortJob frees the landing; nothing held."""
    s = SchedulerSide(BLOCK, 30_000, landing_ttl_ms=4000)
    r = _req("d-5", 40, {"do_remote_prefill": True, "transfer_id": "t5"})
    s.get_num_new_matched_tokens(r, 0)
    s.build_connector_meta()
    assert s.request_finished(r, []) == (False, None)
    assert s.build_connector_meta().aborts == [
        AbortJob("d-5", "t5", "the request ended before it claimed its KV")
    ]
    assert not s.landed


def test_landing_option_a_shrunken_prefix_hit_fails_the_load_instead_of_leaving_holes() -> None:
    """The local prefix hit fell below what the landing skipped: the claim job says why (a failed load)."""
    s = SchedulerSide(BLOCK, 30_000, landing_ttl_ms=4000)
    r = _req("d-6", 150, {"do_remote_prefill": True, "transfer_id": "t6"})
    s.get_num_new_matched_tokens(r, 64)
    s.build_connector_meta()
    s._local_hit["d-6"] = 0  # evicted meanwhile: vLLM matched no local prefix at allocation
    s.update_state_after_alloc(r, _Blocks([7, 8, 9, 10, 11]), 150)
    (claim,) = s.build_connector_meta().claims
    assert claim.why_not and claim.pages == (9, 10, 11)


def test_the_prefill_names_its_kvservice_and_the_decode_loads_name_it_as_sender() -> None:
    """kvservice_peer_address: the prefill's answer carries it as kvservice_sender; the decode's
    RecvJob, LandJob and ClaimJob carry it on to ExpectDelta's sender_address (docs/design/security.md)."""
    p = SchedulerSide(BLOCK, 30_000, peer_address="10.0.0.1:50052")
    r = _req("p-7", 70, {"do_remote_decode": True, "kvservice_peer": "10.0.0.2:50052", "transfer_id": "t7"})
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.request_finished(r, [7, 8, 9])
    assert params["kvservice_sender"] == "10.0.0.1:50052"
    d = SchedulerSide(BLOCK, 30_000)
    rd = _req("d-7", 70, dict(params))
    d.get_num_new_matched_tokens(rd, 0)
    d.update_state_after_alloc(rd, _Blocks([1, 2, 3]), 70)
    assert d.build_connector_meta().recvs == [RecvJob("d-7", "t7", 0, (1, 2, 3), 30_000, "10.0.0.1:50052")]
    dl = SchedulerSide(BLOCK, 30_000, landing_ttl_ms=4000)
    rl = _req("d-8", 70, dict(params))
    dl.get_num_new_matched_tokens(rl, 0)
    assert dl.build_connector_meta().lands == [LandJob("d-8", "t7", 0, 3, 30_000, 4000, "10.0.0.1:50052")]
    dl.update_state_after_alloc(rl, _Blocks([4, 5, 6]), 70)
    (claim,) = dl.build_connector_meta().claims
    assert claim.sender == "10.0.0.1:50052" and not claim.why_not


def test_without_a_named_sender_the_loads_name_none() -> None:
    """No kvservice_peer_address on the prefill (or a non-string value): no sender, as before."""
    s = SchedulerSide(BLOCK, 30_000)
    r = _req("d-9", 40, {"do_remote_prefill": True, "transfer_id": "t9", "kvservice_sender": 5})
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _Blocks([1, 2]), 40)
    assert s.build_connector_meta().recvs[0].sender == ""


# -- layer-wise streaming --------------------------------------------------------------------
class _New:
    def __init__(self, rid: str, blocks: list[int]) -> None:
        self.req_id, self.block_ids = rid, (blocks,)


class _Cached:
    def __init__(self, rows: dict[str, list[int] | None], resumed: set[str] = frozenset()) -> None:
        self.req_ids = list(rows)
        self.new_block_ids = [None if b is None else (b,) for b in rows.values()]
        self.resumed_req_ids = set(resumed)


class _Out:
    """The fields of vLLM's SchedulerOutput the scheduler side reads."""

    def __init__(self, sched: dict[str, int], new: list[_New] = (), cached: _Cached | None = None) -> None:
        self.num_scheduled_tokens = sched
        self.scheduled_new_reqs = list(new)
        self.scheduled_cached_reqs = cached or _Cached({})


def _streamed(n: int = 100) -> tuple[SchedulerSide, Request]:
    s = SchedulerSide(BLOCK, 30_000)
    params = {
        "do_remote_decode": True,
        "kvservice_peer": "10.0.0.2:50051",
        "transfer_id": "ts",
        "kvservice_layerwise": True,
    }
    r = _req("p-s", n, params)
    s.update_state_after_alloc(r, _Blocks([]), 0)
    return s, r


def test_a_chunked_prefill_streams_the_pages_each_step_completes_and_the_last_step_closes_it() -> None:
    """100 tokens (4 pages, the last partial) in steps of 40 and 60 tokens: step 1 completes page
    0 (tokens 0-31), step 2 pages 1-3 with the partial one, last; the answer says layer-wise."""
    s, r = _streamed(100)
    m1 = s.build_connector_meta(_Out({"p-s": 40}, [_New("p-s", [7, 8])]))
    assert m1.chunks == [StreamChunk("p-s", "ts", 0, (7,), False, "10.0.0.2:50051", 30_000)]
    r.num_computed_tokens = 40
    m2 = s.build_connector_meta(_Out({"p-s": 60}, cached=_Cached({"p-s": [9, 10]})))
    assert m2.chunks == [StreamChunk("p-s", "ts", 1, (8, 9, 10), True, "10.0.0.2:50051", 30_000)]
    r.num_computed_tokens, r.status = 100, RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.build_connector_meta(_Out({"p-s": 1})).chunks == []  # nothing after the last chunk
    hold, params = s.request_finished(r, [7, 8, 9, 10])
    assert hold and params is not None and params["kvservice_layerwise"] and params["transfer_id"] == "ts"
    meta = s.build_connector_meta(_Out({}))
    assert meta.stream_ends == [StreamEnd("p-s", "ts")] and meta.sends == []  # never sent twice
    assert s.has_pending_push_work()
    s.finished({"p-s"}, None)
    assert not s.has_pending_push_work()


def test_a_streamed_request_that_ends_early_is_aborted_with_its_blocks_held() -> None:
    s, r = _streamed(100)
    s.build_connector_meta(_Out({"p-s": 40}, [_New("p-s", [7, 8])]))
    r.status = RequestStatus.FINISHED_ABORTED
    hold, params = s.request_finished(r, [7, 8])
    (end,) = s.build_connector_meta(_Out({})).stream_ends
    assert hold and params is None and end.transfer_id == "ts" and end.reason


def test_a_preempted_streamed_request_sends_nothing_more_and_is_aborted() -> None:
    s, r = _streamed(100)
    s.build_connector_meta(_Out({"p-s": 40}, [_New("p-s", [7, 8])]))
    r.num_computed_tokens = 40
    m = s.build_connector_meta(_Out({"p-s": 60}, cached=_Cached({"p-s": [3, 4, 5, 6]}, {"p-s"})))
    assert m.chunks == []
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = s.request_finished(r, [3, 4, 5, 6])
    (end,) = s.build_connector_meta(_Out({})).stream_ends
    assert hold and params is None and "preempted" in end.reason


def test_streaming_off_by_config_or_unasked_sends_at_the_end() -> None:
    """Off by config but asked: one transfer per layer at the end (the decode, told by the same
    params, declares per layer); unasked: one transfer."""
    off, on = SchedulerSide(BLOCK, 30_000, layer_streaming=False), SchedulerSide(BLOCK, 30_000)
    for s, extra, lw in ((off, {"kvservice_layerwise": True}, True), (on, {}, False)):
        r = _req("p-o", 70, {"do_remote_decode": True, "kvservice_peer": "h:1", "transfer_id": "to", **extra})
        s.update_state_after_alloc(r, _Blocks([]), 0)
        assert s.build_connector_meta(_Out({"p-o": 70}, [_New("p-o", [1, 2, 3])])).chunks == []
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = s.request_finished(r, [1, 2, 3])
        assert params is not None and params["kvservice_layerwise"] is lw
        assert s.build_connector_meta(_Out({})).sends == [SendJob("p-o", "to", (1, 2, 3), "h:1", 30_000, lw)]


def test_a_pp_instance_sends_and_loads_layer_by_layer() -> None:
    s = SchedulerSide(BLOCK, 30_000, layer_streaming=False, pipeline_parallel=2)
    r = _req("p-pp", 70, {"do_remote_decode": True, "kvservice_peer": "h:1", "transfer_id": "tp"})
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = s.request_finished(r, [1, 2, 3])
    assert params is not None and params["kvservice_layerwise"] is True
    assert s.build_connector_meta(_Out({})).sends[0].layerwise
    d = _req("d-pp", 70, {"do_remote_prefill": True, "transfer_id": "tp"})  # params silent
    s.get_num_new_matched_tokens(d, 0)
    s.update_state_after_alloc(d, _Blocks([4, 5, 6]), 70)
    assert s.build_connector_meta().recvs[0].layerwise


def test_the_decode_declares_layer_by_layer_only_when_the_params_say_so() -> None:
    s = SchedulerSide(BLOCK, 30_000)
    for tid, extra, want in (("a", {}, False), ("b", {"kvservice_layerwise": True}, True)):
        r = _req(f"d-{tid}", 70, {"do_remote_prefill": True, "transfer_id": tid, **extra})
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, _Blocks([4, 5, 6]), 70)
        (job,) = s.build_connector_meta().recvs
        assert job.layerwise is want and job.pages == (4, 5, 6)
