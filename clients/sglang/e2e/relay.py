"""An SGLang-shaped KV pool between two vLLM instances, driven through kvservice_sglang's classes
in SGLang's scheduler order (cross-engine test: tests/adapters/test_cross_engine_vllm.py).

The pool is SGLang's MHA layout (per layer ``[slots, kv heads, head_dim]`` K and V buffers, page
size ``--page``) in POSIX shared memory. Commands, one JSON object a line on stdin; each answer is
one ``@@ {json}`` line on stdout:

    {"op": "receive", "room": R, "tokens": T}        decode side (on --prefill-service): declare
                                                     slots for T tokens, post the room; answers
                                                     {"ok": true} once declared
    {"op": "wait", "room": R}                        until that room's transfer ends: {"state": ...}
    {"op": "send", "room": R, "tokens": T, "peer": A, "prefix": P}
                                                     prefill side: post room R for peer A (as a
                                                     proxy would; decode_prefix_len P), then send the
                                                     T tokens' slots in two chunks (chunked prefill)
    {"op": "tokens", "tokens": T}                    per layer K and V of the T tokens, hex sha256
    {"op": "quit"}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import urllib.request
from multiprocessing import shared_memory
from typing import Any

import numpy as np
from kvservice_sglang import KVServiceBootstrapServer, KVServiceManager, KVServiceReceiver, KVServiceSender
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll


class Pool:
    def __init__(self, layers: int, heads: int, dim: int, page: int, slots: int) -> None:
        self.layers, self.page, self.slots = layers, page, slots
        self.item = page * heads * dim * 4  # float32 bytes of one page of one buffer
        pages = slots // page
        self.shm = shared_memory.SharedMemory(create=True, size=2 * layers * pages * self.item)
        raw = np.frombuffer(self.shm.buf, dtype=np.uint8)
        raw[:] = 0xA5  # garbage where nothing landed
        self.bufs = [raw[i * pages * self.item : (i + 1) * pages * self.item] for i in range(2 * layers)]
        self.heads = heads

    def kv_args(self) -> KVArgs:
        a = KVArgs()
        a.engine_rank, a.gpu_id, a.page_size = 0, 0, self.page
        a.kv_data_ptrs = [b.ctypes.data for b in self.bufs]
        a.kv_data_lens = [b.nbytes for b in self.bufs]
        a.kv_item_lens = [self.item] * len(self.bufs)
        a.kv_cache_dtype_str = "torch.float32"
        a.kv_head_num = a.total_kv_head_num = self.heads
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [], [], []
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        return a

    def token_rows(self, slots: np.ndarray) -> list[bytes]:
        row = self.item // self.page
        return [b.reshape(-1, row)[slots].tobytes() for b in self.bufs]


def _until(side: Any, timeout: float) -> int:
    end = time.monotonic() + timeout
    while (s := side.poll()) not in (KVPoll.Success, KVPoll.Failed):
        if time.monotonic() > end:
            return int(s)
        time.sleep(0.005)
    return int(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--service", required=True, help="the local kvservice (this 'node')")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=1)
    ap.add_argument("--slots", type=int, default=1024)
    a = ap.parse_args()
    os.environ["SGLANG_KVSERVICE_ADDRESS"] = a.service
    pool = Pool(a.layers, a.heads, a.dim, a.page, a.slots)
    bootstrap = KVServiceBootstrapServer("127.0.0.1", 0)
    addr = f"127.0.0.1:{bootstrap.port}"
    decode = KVServiceManager(pool.kv_args(), "decode", None, False)
    prefill = KVServiceManager(pool.kv_args(), "prefill", None, False)  # the same memory, the other role
    # the tokens live in slots 0..T-1: pages 0..ceil(T/page)-1, in a scrambled page order
    order = np.random.default_rng(3).permutation(a.slots // a.page)
    sides: dict[int, Any] = {}

    def pages_for(tokens: int) -> np.ndarray:
        return order[: -(-tokens // a.page)]

    def slots_for(tokens: int) -> np.ndarray:
        p = pages_for(tokens)
        return (p[:, None] * a.page + np.arange(a.page)[None, :]).reshape(-1)[:tokens]

    print("@@ " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "quit":
            break
        if op == "receive":
            r = KVServiceReceiver(decode, addr, msg["room"])
            r.init(0)
            r.send_metadata(pages_for(msg["tokens"]), decode_prefix_len=0)
            sides[msg["room"]] = r
            answer: dict[str, Any] = {"ok": True}
        elif op == "wait":
            side = sides[msg["room"]]
            state = _until(side, msg.get("timeout", 60))
            names = {v: k for k, v in vars(KVPoll).items() if not k.startswith("_") and isinstance(v, int)}
            answer = {"state": names.get(state, str(state)), "failed": side.failed}
        elif op == "send":
            body = json.dumps({"peer": msg["peer"], "decode_prefix_len": msg.get("prefix", 0)}).encode()
            req = urllib.request.Request(f"http://{addr}/room/{msg['room']}", body, method="PUT")
            urllib.request.urlopen(req, timeout=10).close()  # what a P/D proxy posts for the decode side
            s = KVServiceSender(prefill, addr, msg["room"])
            end = time.monotonic() + 10
            while s.poll() == KVPoll.Bootstrapping and time.monotonic() < end:
                time.sleep(0.005)
            skip = s.pop_decode_prefix_len() // a.page
            pages = pages_for(msg["tokens"])[skip:]
            s.init(len(pages))
            half = len(pages) // 2
            s.send(pages[:half])
            s.send(pages[half:])
            sides[msg["room"]] = s
            answer = {"ok": not s.failed, "failed": s.failed, "pages": len(pages)}
        elif op == "tokens":
            rows = pool.token_rows(slots_for(msg["tokens"]))
            answer = {"sha256": [hashlib.sha256(r).hexdigest() for r in rows]}
        else:
            answer = {"error": f"unknown op {op!r}"}
        print("@@ " + json.dumps(answer), flush=True)
    decode.close()
    prefill.close()
    bootstrap.close()
    del pool.bufs
    pool.shm.close()
    pool.shm.unlink()


if __name__ == "__main__":
    main()
