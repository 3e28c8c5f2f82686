"""Scheduler-thread cost of the vLLM connector per request (goal: <= 100 us p50), with real vLLM
Request objects, beside the cost of building that Request (the baseline, same run).

Run with the vLLM venv (scripts/setup-vllm-cpu.sh):

    .venv-vllm/bin/python bench/bench_adapter_vllm.py --out /tmp/adapter_vllm_scheduler_cpu.json

Per request it times what vLLM calls on its scheduler thread for a disaggregated pair: on the
decode side get_num_new_matched_tokens + update_state_after_alloc + build_connector_meta +
update_connector_output; on the prefill side request_finished + build_connector_meta +
has_pending_push_work + update_connector_output. No RPC runs on that thread (the worker side
does them off-thread), so this is the whole scheduler-side cost.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from kvservice_vllm.scheduler import SchedulerSide
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

BLOCK = 32


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(n: int, prompt_tokens: int) -> dict:
    s = SchedulerSide(BLOCK, 30_000)
    prompt = list(range(prompt_tokens))
    pages = -(-prompt_tokens // BLOCK)
    build_us, decode_us, prefill_us = [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        d = Request(
            f"d{i}",
            prompt,
            SamplingParams(
                max_tokens=8,
                extra_args={"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": f"t{i}"}},
            ),
            None,
        )
        p = Request(
            f"p{i}",
            prompt,
            SamplingParams(
                max_tokens=1,
                extra_args={
                    "kv_transfer_params": {
                        "do_remote_decode": True,
                        "kvservice_peer": "10.0.0.2:50051",
                        "transfer_id": f"t{i}",
                    }
                },
            ),
            None,
        )
        t1 = time.perf_counter()
        blocks = _Blocks(list(range(i % 64, i % 64 + pages)))
        t2 = time.perf_counter()
        count, _ = s.get_num_new_matched_tokens(d, BLOCK * 2)
        s.update_state_after_alloc(d, blocks, count)
        s.build_connector_meta()
        s.finished(None, {d.request_id})
        t3 = time.perf_counter()
        p.status = RequestStatus.FINISHED_LENGTH_CAPPED
        t4 = time.perf_counter()
        s.request_finished(p, blocks.ids)
        s.build_connector_meta()
        s.has_pending_push_work()
        s.finished({p.request_id}, None)
        t5 = time.perf_counter()
        build_us.append((t1 - t0) * 1e6 / 2)
        decode_us.append((t3 - t2) * 1e6)
        prefill_us.append((t5 - t4) * 1e6)

    def stats(xs: list[float]) -> dict:
        return {
            "p50_us": round(statistics.median(xs), 2),
            "p99_us": round(_pct(xs, 0.99), 2),
            "mean_us": round(statistics.fmean(xs), 2),
        }

    return {
        "benchmark": "adapter_vllm_scheduler",
        "requests": n,
        "prompt_tokens": prompt_tokens,
        "block_size": BLOCK,
        "decode_side": stats(decode_us),
        "prefill_side": stats(prefill_us),
        "baseline_build_one_vllm_request": stats(build_us),
        "goal_p50_us": 100,
        "meets_goal": max(statistics.median(decode_us), statistics.median(prefill_us)) <= 100,
        "meta": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "unix_time": int(time.time()),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    run(200, a.prompt_tokens)  # warm
    res = run(a.requests, a.prompt_tokens)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
