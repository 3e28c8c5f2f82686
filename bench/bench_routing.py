"""KV-centric P/D routing on xPyD (seed 002): a trace replayed against real kvservices.

    .venv/bin/python bench/bench_routing.py                 # CPU: 2P2D and 2P4D, both traces
    .venv/bin/python bench/bench_routing.py --small         # CI size (seconds)

One real kvservice per node (P + D service processes on this host); the engines are simulated
in this process: each owns a shared-memory KV pool of fixed capacity and evicts its own cache
(asking its service ``SuggestEvictions``, then ``EvictPages``); compute is modelled as time per
new prefill token (a prefill engine runs one prefill at a time) and per decode token (a decode
engine runs ``decode_slots`` requests at once); the constants are in the JSON. KV bytes are
real: every page written carries its own chained page hash in every word, and every page a
decode engine received is checked word for word before it decodes.

The router uses only kvservice's public API: ``MatchPrefix`` (scores and ``TransferLoad``) on
each node, ``ExpectDelta``'s RESOURCE_EXHAUSTED; besides, like any router, it counts the requests
it has sent to each prefill engine and not yet seen answered (admission policies break ties
between the prefill engines with the longest prefix by that count, prefix-aware P/D
round-robin). A failed turn is counted and the session goes on with its next turn.

Policies, same trace, same engines, one run:

  rr           round-robin P/D: P and D round-robin, the decode engine keeps no cache (full KV
               moves every turn)
  prefix       prefix-aware P/D, delta-only: P and D with the longest cached prefix
  admission    prefix + transfer-aware admission: a turn goes direct to the decode engine that
               holds its prefix when the append is small and that engine's inbound transfers are
               low; otherwise P/D to the best-prefix D that admits (TransferLoad.admits, budget
               ``--budget``), falling back at once to the next D on RESOURCE_EXHAUSTED
  admission+landing  admission, and a decode engine that cannot allocate the request's pages at
               once lands the transfer instead (ExpectDelta.landing): the prefill sends at once,
               its pages are free at LANDED, and the decode engine allocates afterwards (while
               it waits, its pool holds no idle pre-allocated pages) and claims the landed pages;
               a refused landing (pool full, budget) falls back to the next decode engine
  admission+dup  the same, plus duplicate-aware eviction on the prefill services
               (duplicate_policy=lower: pages the decode side also holds are evicted first),
               steered by the router: while most later turns of its conversations went back
               through a prefill engine rather than direct to decode, it sends with
               SendDelta(no_duplicate_mark), so prefill keeps what it will need again; the other
               policies run the services with duplicate_policy=off (LRU)

Per policy: ok/total, errors by type, end-to-end and TTFT mean/p50/p90/p99, cached tokens,
prefill new tokens, prefill-side cached tokens, bytes moved, decode transfer queue mean/p90
(sampled from MatchPrefix load), pages verified, prefill pages held (page-seconds a request
pins its pages on the prefill engine, from its prefill until its transfer ended: DONE, or LANDED
with landing), landing pool peak, claim time.

A request's prefill pin is released when its transfer ended (DONE or LANDED), in every policy: the
pages stay cached on the prefill engine (evictable), as with SGLang's release-after-transfer.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from _harness import Services, progress, summarize, write_json
from kvservice_client import Client, KVClientError, Layout, ResourceExhausted, ShmKVPool
from kvservice_client.hashing import page_hashes
from routing_trace import Trace, Turn, generate, profile

POLICIES = ("rr", "prefix", "admission", "admission+dup", "admission+landing")


@dataclasses.dataclass(frozen=True)
class Model:
    """Compute model and sizes (written to the JSON)."""

    page_size: int = 16
    layers: int = 2
    heads: int = 1
    head_dim: int = 64  # 4 KiB per page per region (fp16)
    prefill_us_per_token: float = 50.0
    decode_ms_per_token: float = 0.5
    decode_slots: int = 8
    prefill_pages: int = 3072  # per prefill engine: cache pressure
    decode_pages: int = 4096
    request_timeout_s: float = 6.0
    time_scale: float = 0.35  # multiplies the trace's think times and session starts
    direct_max_append: int = 1024  # tokens a decode engine prefills itself (direct-to-D)
    direct_max_inbound: int = 1  # ... only while its inbound transfers are at most this
    budget: int = 4  # inbound_max_transfers per decode engine (admission policies)
    landing_pool_mb: int = 64  # per decode node (admission+landing)
    overlap_prealloc: int = 0  # 1: the decode side declares while the prefill runs (seed 002's shape)
    landing_always: int = 0  # admission+landing: 1 lands every P/D transfer (no pre-allocation at all)
    same_host_route: str = "auto"  # "off": P and D services talk as two hosts would (xPyD across nodes)


Declared = tuple["Engine", list[int], str, int, list[int]]


class Fail(Exception):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Engine:
    """A simulated engine: a shm KV pool registered with its node's kvservice, a free list,
    eviction through SuggestEvictions, and a compute model."""

    def __init__(self, name: str, role: str, address: str, m: Model, budget: int = 0) -> None:
        self.name, self.role, self.address, self.m = name, role, address, m
        pages = m.prefill_pages if role == "P" else m.decode_pages
        self.layout = Layout.mha(
            num_layers=m.layers,
            page_size=m.page_size,
            num_pages=pages,
            total_kv_heads=m.heads,
            head_dim=m.head_dim,
            dtype="float16",
        )
        self.pool = ShmKVPool.create(self.layout)
        self.client = Client(address, client_name=name, timeout=30)
        self.bs = self.client.register_buffers(
            self.layout,
            self.pool.k_regions,
            self.pool.v_regions,
            engine_id=name,
            inbound_max_transfers=budget,
        ).buffer_set_id
        self.words = [
            r.view(np.uint64).reshape(pages, -1)
            for i in range(m.layers)
            for r in (self.pool.k(i), self.pool.v(i))
        ]
        self.free = list(range(pages))
        self.protected: set[int] = set()  # pages of running requests not yet leased
        self.lock = threading.RLock()  # eviction, leases and publishes of this engine, one at a time
        self.compute = threading.Semaphore(1 if role == "P" else m.decode_slots)
        self.evicted_pages = 0
        self.waiting = 0  # requests waiting in alloc for pages (the pre-allocation queue)

    def close(self) -> None:
        self.client.close()
        self.pool.close()

    # -- memory ----------------------------------------------------------------------------
    def alloc(self, n: int, deadline: float, kind: str) -> list[int]:
        """``n`` free pages, evicting cached ones (the service suggests which) as needed; waits
        (the prealloc queue) until ``deadline``, then fails with ``kind``."""
        waited = False
        try:
            while True:
                got = self._alloc_once(n)
                if got is not None:
                    return got
                if time.monotonic() > deadline:
                    raise Fail(kind)
                if not waited:
                    waited = True
                    with self.lock:
                        self.waiting += 1
                time.sleep(0.005)
        finally:
            if waited:
                with self.lock:
                    self.waiting -= 1

    def _alloc_once(self, n: int) -> list[int] | None:
        """One try: evict what the service suggests if needed, then take ``n`` free pages or None."""
        with self.lock:
            if len(self.free) < n:
                want = n - len(self.free)
                sug = self.client.suggest_evictions(self.bs, want + len(self.protected) + 16)
                take = []
                for p in sug.page_indices:  # cut at a protected page: its ancestors follow it
                    if p in self.protected or len(take) >= want:
                        break
                    take.append(p)
                if take:
                    self.client.evict_pages(self.bs, take)
                    self.free.extend(take)
                    self.evicted_pages += len(take)
            if len(self.free) >= n:
                out, self.free = self.free[:n], self.free[n:]
                self.protected.update(out)
                return out
        return None

    def try_alloc(self, n: int) -> list[int] | None:
        """``n`` pages now (evicting cached ones if that suffices), or None: no waiting. None too
        while others wait for pages: the pre-allocation queue is FIFO, nobody jumps it."""
        if self.waiting:
            return None
        return self._alloc_once(n)

    def give(self, pages: list[int]) -> None:
        with self.lock:
            self.free.extend(pages)
            self.protected.difference_update(pages)

    def unprotect(self, pages: list[int]) -> None:
        with self.lock:
            self.protected.difference_update(pages)

    def settle(self, tokens: np.ndarray, pages: list[int], old_lease: str) -> tuple[list[int], str]:
        """Cache ``tokens`` (whose full pages are ``pages``, written by this request) and pin it
        for the rest of the request: like a radix cache insert, pages already cached under the
        same prefix (another request was first) are kept and this request's copies freed.
        Returns (the pages now holding the sequence, the new lease id); releases ``old_lease``."""
        n = len(pages)
        with self.lock:
            m = self.match(tokens)
            have = list(m.best.page_indices)[:n] if m.best else []
            keep = have + pages[len(have) :]
            dup = [p for p, q in zip(pages[: len(have)], have, strict=True) if p != q]
            if len(have) < n:
                self.client.publish_pages(self.bs, keep, tokens=tokens[: n * self.m.page_size])
            lease = self.match(tokens[: n * self.m.page_size], lease_ms=int(self.m.request_timeout_s * 1000))
            self.protected.difference_update(pages)
            self.free.extend(dup)
        self.release(old_lease)
        return keep, lease.lease_id

    # -- KV bytes --------------------------------------------------------------------------
    def write(self, pages: list[int], hashes: np.ndarray) -> None:
        idx = np.asarray(pages, dtype=np.int64)
        for i, w in enumerate(self.words):
            w[idx] = (hashes ^ np.uint64(i))[:, None]

    def verify(self, pages: list[int], hashes: np.ndarray) -> bool:
        idx = np.asarray(pages, dtype=np.int64)
        return all(bool((w[idx] == (hashes ^ np.uint64(i))[:, None]).all()) for i, w in enumerate(self.words))

    def match(self, tokens: np.ndarray, lease_ms: int = 0) -> Any:
        """The engine's cached prefix of ``tokens``; with ``lease_ms`` pinned, under the engine's
        lock so an eviction in progress cannot free a page as it is being pinned."""
        with self.lock if lease_ms else contextlib.nullcontext():
            return self.client.match_prefix(
                tokens=tokens, page_size=self.m.page_size, buffer_set_ids=[self.bs], lease_ttl_ms=lease_ms
            )

    def release(self, lease_id: str) -> None:
        if lease_id:
            try:
                self.client.release_lease(lease_id)
            except KVClientError:
                pass  # expired


@dataclasses.dataclass
class Result:
    ok: bool = False
    error: str = ""
    e2e_s: float = 0.0
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens not computed for this request
    p_cached_tokens: int = 0  # of those, found in the prefill engine's cache
    new_tokens: int = 0  # prompt tokens computed (prefill or direct on decode)
    bytes_moved: int = 0
    route: str = ""
    fallbacks: int = 0
    verified_pages: int = 0
    detail: str = ""  # the first words of an RPC error
    prefill_page_s: float = 0.0  # pages pinned on the prefill engine x seconds (prefill to transfer end)
    landed: bool = False  # went through the landing pool
    claim_us: int = 0  # the service's time on the claim


class Router:
    """Routes one request with the policy; uses only kvservice's public API."""

    def __init__(self, policy: str, prefill: list[Engine], decode: list[Engine], m: Model) -> None:
        self.policy, self.P, self.D, self.m = policy, prefill, decode, m
        self._rr = itertools.count()
        self._tid = itertools.count()
        self.busy: collections.Counter[str] = collections.Counter()  # requests this router sent to a P
        self.later: collections.Counter[str] = collections.Counter()  # routes of turns after the first
        self._pool = ThreadPoolExecutor(128, thread_name_prefix="declare")  # overlap_prealloc

    def marks_duplicates(self) -> bool:
        """admission+dup: let the prefill side mark what it sends as a P/D duplicate only while
        later turns have mostly gone direct to decode (then prefill will not need the pages)."""
        return self.policy == "admission+dup" and self.later["direct"] >= self.later["pd"]

    def scores(self, engines: list[Engine], prompt: np.ndarray) -> list[tuple[int, Any, Engine]]:
        """(matched pages, load, engine) per engine: one MatchPrefix (scores_only) per node."""
        out = []
        for e in engines:
            (m,) = e.client.match_prefix(
                tokens=prompt, page_size=self.m.page_size, buffer_set_ids=[e.bs], scores_only=True
            ).matches
            out.append((m.matched_pages, m.load, e))
        return out

    def admits(self, e: Engine, prompt: np.ndarray) -> bool:
        """Whether ``e``'s inbound budget admits a transfer now (one scores-only MatchPrefix)."""
        (m,) = e.client.match_prefix(
            tokens=prompt[: self.m.page_size],
            page_size=self.m.page_size,
            buffer_set_ids=[e.bs],
            scores_only=True,
        ).matches
        return bool(m.load.admits)

    def serve(self, turn: Turn) -> Result:
        m, res = self.m, Result(prompt_tokens=turn.prompt_tokens)
        t0 = time.monotonic()
        deadline = t0 + m.request_timeout_s
        tid = f"r{next(self._tid)}-s{turn.session}-t{turn.turn}"
        n_pages = turn.prompt_tokens // m.page_size
        hashes = page_hashes(turn.prompt, m.page_size)
        try:
            rr = next(self._rr)
            if self.policy == "rr":
                plan = [(0, self.D[rr % len(self.D)])]
                p_eng = self.P[rr % len(self.P)]
            else:
                d_scores = self.scores(self.D, turn.prompt)
                if self.policy == "prefix":
                    best = max(s[0] for s in d_scores)
                    ties = [s for s in d_scores if s[0] == best]
                    plan = [(ties[rr % len(ties)][0], ties[rr % len(ties)][2])]
                else:
                    ranked = sorted(
                        d_scores, key=lambda s: (-s[0] if s[1].admits else 1, s[1].inbound_transfers)
                    )
                    top_pages, top_load, top = ranked[0]
                    append = turn.prompt_tokens - top_pages * m.page_size
                    direct = (
                        top_pages
                        and append <= m.direct_max_append
                        and top_load.inbound_transfers <= m.direct_max_inbound
                    )
                    if turn.turn:
                        self.later["direct" if direct else "pd"] += 1
                    if direct:
                        return self._direct(turn, top, hashes, res, t0, deadline)
                    plan = [(s[0], s[2]) for s in ranked]
                p_scores = self.scores(self.P, turn.prompt)
                best = max(s[0] for s in p_scores)
                if self.policy == "prefix":
                    ties = [s for s in p_scores if s[0] == best]
                    p_eng = ties[rr % len(ties)][2]
                else:  # the longest prefix; among those, the prefill engine with the fewest requests
                    p_eng = min((x for x in p_scores if x[0] == best), key=lambda x: self.busy[x[2].name])[2]
            self.busy[p_eng.name] += 1
            try:
                return self._pd(turn, plan, p_eng, hashes, n_pages, tid, res, t0, deadline)
            finally:
                self.busy[p_eng.name] -= 1
        except Fail as f:
            res.error = f.kind
        except KVClientError as exc:
            res.error, res.detail = f"rpc:{type(exc).__name__}", str(exc)[:300]
        res.e2e_s = time.monotonic() - t0
        return res

    # -- direct to the decode engine that holds the prefix ---------------------------------------
    def _direct(
        self, turn: Turn, d: Engine, hashes: np.ndarray, res: Result, t0: float, deadline: float
    ) -> Result:
        m = self.m
        res.route = "direct"
        lease = d.match(turn.prompt, lease_ms=int(m.request_timeout_s * 1000))
        lease_id = lease.lease_id
        try:
            have = lease.best.matched_pages if lease.best else 0
            prefix = list(lease.best.page_indices) if lease.best else []
            new_pages = d.alloc(hashes.size - have, deadline, "decode_prealloc_timeout")
            try:
                with d.compute:
                    time.sleep((turn.prompt_tokens - have * m.page_size) * m.prefill_us_per_token / 1e6)
                d.write(new_pages, hashes[have:])
                pages, lease_id = d.settle(turn.prompt, prefix + new_pages, lease.lease_id)
            except BaseException:
                d.give(new_pages)
                raise
            res.cached_tokens = have * m.page_size
            res.new_tokens = turn.prompt_tokens - res.cached_tokens
            res.ttft_s = time.monotonic() - t0
            self._decode(turn, d, pages, deadline)
        finally:
            d.release(lease_id)
        res.ok, res.e2e_s = True, time.monotonic() - t0
        return res

    def _declare(
        self, turn: Turn, plan: list[tuple[int, Engine]], n_pages: int, tid: str, res: Result, deadline: float
    ) -> Declared:
        """The decode side's declaration: (engine, destination pages, lease, prefix pages, their
        indices). Refused everywhere (every D over its budget): wait a little and ask again,
        within the request's deadline. admission+landing: a D without room now gets a landing."""
        m = self.m
        keep_cache = self.policy != "rr"
        for cand in itertools.chain.from_iterable(itertools.repeat([c for _, c in plan])):
            if cand is plan[0][1] and res.fallbacks and time.monotonic() > deadline:
                raise Fail("admission_timeout")
            if cand is plan[0][1] and res.fallbacks >= len(plan):
                time.sleep(0.02)
            landing = self.policy == "admission+landing"
            if landing and not self.admits(cand, turn.prompt):  # over budget: skip it untouched
                res.fallbacks += 1  # NOTE: no lease, no eviction for a declaration that would be refused
                continue
            ml = cand.match(turn.prompt, lease_ms=int(m.request_timeout_s * 1000)) if keep_cache else None
            have = ml.best.matched_pages if ml is not None and ml.best else 0
            prefix = list(ml.best.page_indices) if ml is not None and ml.best else []
            pages = (None if m.landing_always else cand.try_alloc(n_pages - have)) if landing else []
            try:
                if pages is None:  # no room now: land it, allocate after it landed
                    left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
                    cand.client.expect_landing(
                        tid,
                        cand.bs,
                        prefix_pages=have,
                        pages=n_pages - have,
                        ttl_ms=left_ms,
                        deadline_ms=left_ms,
                        publish_tokens=turn.prompt,
                        prefix_page_indices=prefix,
                    )
                    res.landed = True
                    return cand, [], ml.lease_id if ml else "", have, prefix
                pages = pages or cand.alloc(n_pages - have, deadline, "decode_prealloc_timeout")
            except Fail:
                if ml is not None:
                    cand.release(ml.lease_id)
                raise
            except ResourceExhausted:  # landing pool full or over budget: the next candidate
                if ml is not None:
                    cand.release(ml.lease_id)
                res.fallbacks += 1
                continue
            try:
                cand.client.expect_delta(
                    tid,
                    cand.bs,
                    prefix_pages=have,
                    dst_page_indices=pages,
                    deadline_ms=max(int((deadline - time.monotonic()) * 1000), 1),
                    publish_tokens=turn.prompt if keep_cache else None,
                    prefix_page_indices=prefix if keep_cache else (),
                )
            except ResourceExhausted:  # over its inbound budget: the next candidate, at once
                cand.give(pages)
                if ml is not None:
                    cand.release(ml.lease_id)
                res.fallbacks += 1
                continue
            return cand, pages, ml.lease_id if ml else "", have, prefix
        raise AssertionError("unreachable")

    # -- prefill -> decode ---------------------------------------------------------------------
    def _pd(
        self,
        turn: Turn,
        plan: list[tuple[int, Engine]],
        p: Engine,
        hashes: np.ndarray,
        n_pages: int,
        tid: str,
        res: Result,
        t0: float,
        deadline: float,
    ) -> Result:
        m = self.m
        res.route = "pd"
        keep_cache = self.policy != "rr"
        d_lease, dst, d, d_done, d_have, d_prefix = "", [], None, False, 0, []
        declared: Future[Declared] | None = None
        if m.overlap_prealloc:  # the decode side pre-allocates while the prefill runs (SGLang)
            declared = self._pool.submit(self._declare, turn, plan, n_pages, tid, res, deadline)
        else:  # decode side first: declare where the pages go, then prefill
            d, dst, d_lease, d_have, d_prefix = self._declare(turn, plan, n_pages, tid, res, deadline)
        p_lease, new, published = "", [], False
        try:
            pl = p.match(turn.prompt, lease_ms=int(m.request_timeout_s * 1000))
            p_lease = pl.lease_id
            p_have = pl.best.matched_pages if pl.best else 0
            p_prefix = list(pl.best.page_indices) if pl.best else []
            with p.compute:
                time.sleep((turn.prompt_tokens - p_have * m.page_size) * m.prefill_us_per_token / 1e6)
            new = p.alloc(n_pages - p_have, deadline, "prefill_alloc_timeout")
            p.write(new, hashes[p_have:])
            src, p_lease = p.settle(turn.prompt, p_prefix + new, p_lease)
            published, t_pinned = True, time.monotonic()
            if declared is not None:  # the prefill is done and pinned: wait for the decode side
                d, dst, d_lease, d_have, d_prefix = declared.result()
            assert d is not None
            p.client.send_delta(
                tid,
                p.bs,
                src_page_indices=src,
                peer_address=d.address,
                deadline_ms=max(int((deadline - time.monotonic()) * 1000), 1),
                no_duplicate_mark=not self.marks_duplicates(),
            )
            res.p_cached_tokens = p_have * m.page_size
            res.new_tokens = turn.prompt_tokens - res.p_cached_tokens
            res.cached_tokens = res.p_cached_tokens
            left = max(deadline - time.monotonic(), 0.01)
            try:
                (st,) = (
                    d.client.wait_landed(tid, timeout=left)
                    if res.landed
                    else d.client.wait(tid, timeout=left)
                )
            except KVClientError:
                raise Fail("transfer_timeout") from None
            if st.state != ("LANDED" if res.landed else "DONE"):
                raise Fail(f"transfer_{st.error_code or st.state}".lower())
            res.prefill_page_s = len(src) * (time.monotonic() - t_pinned)
            p.release(p_lease)  # the transfer ended (DONE or LANDED): the prefill pages are free
            p_lease = ""
            if res.landed:  # now the decode engine allocates, then claims the landed pages
                dst = d.alloc(n_pages - d_have, deadline, "decode_prealloc_timeout")
                try:
                    c = d.client.claim(
                        tid,
                        d.bs,
                        dst_page_indices=dst,
                        wait_ms=max(int((deadline - time.monotonic()) * 1000), 1),
                    )
                except KVClientError as exc:
                    raise Fail(f"claim_{type(exc).__name__}") from None
                st, res.claim_us = c.status, c.claim_us
            d_done = keep_cache  # published by the service on DONE: cached, no longer ours to free
            res.bytes_moved = st.bytes_sent
            if not d.verify(dst, hashes[d_have:]):
                raise Fail("kv_mismatch")
            res.verified_pages = len(dst)
            res.ttft_s = time.monotonic() - t0
            pages = d_prefix + dst
            if keep_cache:  # the service published on DONE; settle pins it (or dedups a race)
                pages, d_lease = d.settle(turn.prompt, pages, d_lease)
            self._decode(turn, d, pages, deadline)
            if not keep_cache:
                d.give(dst)
        except BaseException:
            if not published:
                p.give(new)
            if d is None and declared is not None:  # the prefill failed first: undo the declaration
                with contextlib.suppress(BaseException):
                    d, dst, d_lease, d_have, d_prefix = declared.result()
            if d is not None:
                with contextlib.suppress(KVClientError):
                    d.client.abort(tid, "request failed")
                if d_done:
                    d.unprotect(dst)
                else:
                    d.give(dst)  # never published (or aborted): back to the free list
            raise
        finally:
            p.release(p_lease)
            if d is not None:
                d.release(d_lease)
        res.ok, res.e2e_s = True, time.monotonic() - t0
        return res

    def _decode(self, turn: Turn, d: Engine, pages: list[int], deadline: float) -> None:
        """Decode the output; its KV pages join the decode engine's cache for the next turn."""
        m = self.m
        with d.compute:
            time.sleep(turn.output.size * m.decode_ms_per_token / 1e3)
        if self.policy == "rr":
            return
        seq = np.concatenate([turn.prompt, turn.output])
        h = page_hashes(seq, m.page_size)
        extra = h.size - len(pages)
        if extra <= 0:
            return
        try:
            out = d.alloc(extra, deadline, "decode_output_alloc")
        except Fail:
            return  # the answer stands; its KV is just not cached
        d.write(out, h[len(pages) :])
        try:
            _, lease_id = d.settle(seq, pages + out, "")
        except BaseException:
            d.give(out)
            raise
        d.release(lease_id)


def replay(trace: Trace, router: Router, m: Model, concurrency: int) -> list[Result]:
    """Sessions run concurrently; a session's next turn starts a think time after the answer."""
    results: list[Result] = []
    lock = threading.Lock()

    def session(turns: list[Turn]) -> None:
        time.sleep(turns[0].start_s * m.time_scale)
        for t in turns:
            if t.turn:
                time.sleep(t.start_s * m.time_scale)
            r = router.serve(t)
            with lock:
                results.append(r)
            # a failed turn is counted; the conversation goes on with the trace's next turn

    with ThreadPoolExecutor(concurrency) as pool:
        list(progress(pool.map(session, trace.sessions), "sessions", total=len(trace.sessions)))
    assert len(results) == trace.requests
    return results


class QueueSampler:
    """Every 50 ms: each decode engine's inbound transfers, read from MatchPrefix's load."""

    def __init__(self, decode: list[Engine], page_size: int) -> None:
        self.D, self.ps = decode, page_size
        self.samples: list[int] = []
        self.call_s: list[float] = []  # MatchPrefix latency as a router sees it, under the load
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        probe = np.zeros(self.ps, dtype=np.uint32)
        while not self._stop.wait(0.05):
            for e in self.D:
                t0 = time.perf_counter()
                (mt,) = e.client.match_prefix(
                    tokens=probe, page_size=self.ps, buffer_set_ids=[e.bs], scores_only=True
                ).matches
                self.call_s.append(time.perf_counter() - t0)
                self.samples.append(mt.load.inbound_transfers)

    def __enter__(self) -> QueueSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)


def replay_sequential(trace: Trace, router: Router, nominal_s: float = 0.5) -> list[Result]:
    """Every turn alone, in the trace's arrival order (each answer taking ``nominal_s``): no
    timing in the routing decisions, so two eviction policies see the same requests."""
    order = []
    for turns in trace.sessions:
        t = 0.0
        for turn in turns:
            t += turn.start_s + (nominal_s if turn.turn else 0.0)
            order.append((t, turn.session, turn.turn, turn))
    order.sort(key=lambda x: x[:3])
    return [router.serve(turn) for *_, turn in order]


def run_policy(
    policy: str, trace: Trace, n_p: int, n_d: int, m: Model, concurrency: int, sequential: bool = False
) -> dict[str, Any]:
    admission = policy.startswith("admission")
    p_env = {"KVSERVICE_DUPLICATE_POLICY": "lower" if policy == "admission+dup" else "off",
             "KVSERVICE_DUPLICATE_CHECK_MS": "200",
             "KVSERVICE_SAME_HOST_ROUTE": m.same_host_route}  # fmt: skip
    d_env = {"KVSERVICE_DUPLICATE_POLICY": "off", "KVSERVICE_LANDING_POOL_MB": str(m.landing_pool_mb),
             "KVSERVICE_SAME_HOST_ROUTE": m.same_host_route}  # fmt: skip
    with Services(n_p, env=p_env) as ps, Services(n_d, env=d_env) as ds:
        P = [Engine(f"prefill-{i}", "P", a, m) for i, a in enumerate(ps.addresses)]
        D = [
            Engine(f"decode-{i}", "D", a, m, m.budget if admission else 0) for i, a in enumerate(ds.addresses)
        ]
        try:
            router = Router(policy, P, D, m)
            t0 = time.monotonic()
            with QueueSampler(D, m.page_size) as q:
                results = (
                    replay_sequential(trace, router) if sequential else replay(trace, router, m, concurrency)
                )
            wall = time.monotonic() - t0
            dup_pages = [
                next(b.duplicated_pages for b in e.client.get_stats().buffer_sets if b.buffer_set_id == e.bs)
                for e in P
            ]
            landing = [ls for e in D for ls in e.client.get_stats().landing]
        finally:
            for e in P + D:
                e.close()
    ok = [r for r in results if r.ok]
    errors = collections.Counter(r.error for r in results if not r.ok)
    qs = np.asarray(q.samples or [0], dtype=np.float64)
    return {
        "policy": policy,
        "ok": len(ok),
        "total": len(results),
        "errors": dict(sorted(errors.items())),
        "error_details": sorted({f"{r.error}: {r.detail}" for r in results if r.detail})[:10],
        "e2e": summarize([r.e2e_s for r in ok]),
        "ttft": summarize([r.ttft_s for r in ok]),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "prefill_cached_tokens": sum(r.p_cached_tokens for r in ok),
        "prefill_new_tokens": sum(r.new_tokens for r in ok),
        "bytes_moved": sum(r.bytes_moved for r in ok),
        "routes": dict(collections.Counter(r.route for r in ok)),
        "fallbacks": sum(r.fallbacks for r in results),
        "decode_transfer_queue": {
            "mean": float(qs.mean()),
            "p90": float(np.percentile(qs, 90)),
            "max": float(qs.max()),
        },
        "pages_verified": sum(r.verified_pages for r in ok),
        "prefill_page_s": sum(r.prefill_page_s for r in results),
        "landed": sum(r.landed for r in ok),
        "claim_us": summarize([r.claim_us / 1e6 for r in ok if r.landed]),
        "landing_pool": {
            "peak_bytes": max((ls.peak_bytes for ls in landing), default=0),
            "capacity_bytes": max((ls.capacity_bytes for ls in landing), default=0),
            "claims": sum(ls.claims for ls in landing),
            "expired": sum(ls.expired for ls in landing),
            "evicted": sum(ls.evicted for ls in landing),
            "refused": sum(ls.refused for ls in landing),
            "in_use_at_end": sum(ls.used_bytes for ls in landing),
        },
        "router_match_prefix_under_load": summarize(q.call_s),
        "prefill_evicted_pages": sum(e.evicted_pages for e in P),
        "prefill_duplicated_pages_at_end": dup_pages,
        "wall_s": wall,
        # per request, in completion order: route, ok, error, e2e and TTFT (ms), for tails' causes
        "requests": [
            [r.route, r.ok, r.error, round(r.e2e_s * 1e3, 1), round(r.ttft_s * 1e3, 1)] for r in results
        ],
    }


def router_latency(iters: int, prompt_tokens: int = 131_072) -> dict[str, Any]:
    """Goals: MatchPrefix with load <= 5 ms p50 at 128K tokens; an over-budget ExpectDelta refused
    in <= 1 ms p50. Baseline in the same run: a health check (one empty RPC on the same socket)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ps = 16
    big = Layout.mha(num_layers=1, page_size=ps, num_pages=prompt_tokens // ps + 8, total_kv_heads=1,
                     head_dim=8, dtype="float16")  # fmt: skip
    small = Layout.mha(
        num_layers=1, page_size=ps, num_pages=64, total_kv_heads=1, head_dim=8, dtype="float16"
    )
    prompt = np.random.default_rng(1).integers(0, 150_000, prompt_tokens, dtype=np.int64)
    lat: dict[str, list[float]] = {
        "health": [],
        "match_prefix_128k_scores": [],
        "expect_delta_refused": [],
        "expect_delta_refused_raw_stub": [],  # without the SDK (no request id, no retry wrapper)
    }
    with Services(1) as svc, Client(svc.addresses[0], client_name="router-latency") as kc:
        pools = [ShmKVPool.create(big)] + [ShmKVPool.create(small) for _ in range(3)]
        try:
            ib = kc.register_buffers(
                big, pools[0].k_regions, pools[0].v_regions, engine_id="idx"
            ).buffer_set_id
            kc.publish_pages(ib, np.arange(prompt_tokens // ps), tokens=prompt)
            busy = []
            for i, p in enumerate(pools[1:]):  # engines with a transfer in flight and a full budget
                b = kc.register_buffers(
                    small, p.k_regions, p.v_regions, engine_id=f"d{i}", inbound_max_transfers=1
                )
                kc.expect_delta(f"held-{i}", b.buffer_set_id, prefix_pages=0, dst_page_indices=[0, 1],
                                deadline_ms=600_000)  # fmt: skip
                busy.append(b.buffer_set_id)
            with grpc.insecure_channel(svc.addresses[0]) as ch:
                from kvservice_client._proto import kvservice_pb2, kvservice_pb2_grpc

                health = health_pb2_grpc.HealthStub(ch)
                stub = kvservice_pb2_grpc.KVServiceStub(ch)
                md = (("kvservice-session", kc.session_id),)
                for i in range(iters + 5):
                    t0 = time.perf_counter()
                    health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    t1 = time.perf_counter()
                    res = kc.match_prefix(tokens=prompt, page_size=ps, scores_only=True)
                    t2 = time.perf_counter()
                    try:
                        kc.expect_delta(f"over-{i}", busy[i % 3], prefix_pages=0, dst_page_indices=[5])
                        raise RuntimeError("an over-budget ExpectDelta was admitted")
                    except ResourceExhausted:
                        pass
                    t3 = time.perf_counter()
                    try:
                        stub.ExpectDelta(
                            kvservice_pb2.ExpectDeltaRequest(
                                transfer_id=f"raw-{i}", buffer_set_id=busy[i % 3], dst_page_indices=[5]
                            ),
                            metadata=md,
                            timeout=5,
                        )
                        raise RuntimeError("an over-budget ExpectDelta was admitted")
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    t4 = time.perf_counter()
                    if i >= 5:  # warm-up
                        lat["health"].append(t1 - t0)
                        lat["match_prefix_128k_scores"].append(t2 - t1)
                        lat["expect_delta_refused"].append(t3 - t2)
                        lat["expect_delta_refused_raw_stub"].append(t4 - t3)
            assert res.best is not None and res.best.matched_pages == prompt_tokens // ps
            assert all(m.load.inbound_transfers == 1 for m in res.matches if m.buffer_set_id in busy)
        finally:
            for p in pools:
                p.close()
    return {k: summarize(v) for k, v in lat.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CI size: one config, short traces")
    ap.add_argument("--configs", default=None, help="default 2P2D,2P4D (--small: 2P2D)")
    ap.add_argument("--shapes", default=None, help="default micro,small-append (--small: small-append)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=64, help="sessions replayed at once (threads)")
    ap.add_argument("--device", default="cpu", help="cpu only for now (shm pools)")
    ap.add_argument("--out", default="/tmp/kvservice-bench")
    ap.add_argument("--tag", default="")
    ap.add_argument("--latency-only", action="store_true", help="only the router call latencies")
    ap.add_argument("--skip-replay", action="store_true", help="no timed replay (eviction, latency)")
    ap.add_argument("--replay-only", action="store_true", help="only the timed replay (no eviction, latency)")
    for f in dataclasses.fields(Model):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)
    args = ap.parse_args()
    if args.device != "cpu":
        sys.exit("bench_routing: --device cuda is not built yet (engines are simulated on shm pools)")
    over = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(Model) if getattr(args, f.name) is not None
    }
    scale = 1.0
    if args.small:
        over = {"prefill_pages": 1024, "decode_pages": 1536, **over}
        scale = 0.25
    args.configs = args.configs or ("2P2D" if args.small else "2P2D,2P4D")
    args.shapes = args.shapes or ("small-append" if args.small else "micro,small-append")
    m = Model(**over)
    runs = []
    for shape in [] if args.latency_only or args.skip_replay else args.shapes.split(","):
        trace = generate(shape, args.seed, scale)
        if args.small:  # a few sessions only
            trace = Trace(trace.shape, trace.seed, trace.sessions[:10])
        for cfg in args.configs.split(","):
            n_p, n_d = (int(x) for x in cfg.upper().rstrip("D").split("P"))
            for policy in args.policies.split(","):
                r = run_policy(policy, trace, n_p, n_d, m, args.concurrency)
                r.update(config=cfg, shape=shape, trace=profile(trace, m.page_size))
                runs.append(r)
                q = r["decode_transfer_queue"]
                print(
                    f"{shape:12s} {cfg} {policy:14s} ok {r['ok']}/{r['total']} errors {r['errors']} "
                    f"e2e p50 {r['e2e'].get('p50_ms', 0):.0f} p99 {r['e2e'].get('p99_ms', 0):.0f} ms  "
                    f"cached {r['cached_tokens']}  P-cached {r['prefill_cached_tokens']}  "
                    f"queue mean {q['mean']:.2f} p90 {q['p90']:.0f}  "
                    f"ttft p99 {r['ttft'].get('p99_ms', 0):.0f} ms  "
                    f"P page-s {r['prefill_page_s']:.0f}  landed {r['landed']} "
                    f"peak {r['landing_pool']['peak_bytes'] >> 20} MiB",
                    file=sys.stderr,
                )
    # Eviction alone: the same requests one at a time (no timing), LRU vs duplicate-aware on P.
    eviction = []
    seq_model = dataclasses.replace(m, prefill_us_per_token=0.0, decode_ms_per_token=0.0, time_scale=0.0)
    for shape in [] if args.latency_only or args.replay_only else args.shapes.split(","):
        trace = generate(shape, args.seed, scale)
        if args.small:
            trace = Trace(trace.shape, trace.seed, trace.sessions[:10])
        for policy in ("admission", "admission+dup"):
            r = run_policy(policy, trace, 2, 2, seq_model, 1, sequential=True)
            r.update(config="2P2D", shape=shape, mode="sequential")
            eviction.append(r)
            print(
                f"eviction {shape:12s} {policy:14s} ok {r['ok']}/{r['total']} "
                f"P-cached {r['prefill_cached_tokens']} new {r['prefill_new_tokens']} "
                f"P-evicted {r['prefill_evicted_pages']} errors {r['errors']}",
                file=sys.stderr,
            )
    latency = {} if args.replay_only else router_latency(50 if args.small else 300)
    if latency:
        print(
            "router calls: MatchPrefix 128K scores p50 "
            f"{latency['match_prefix_128k_scores']['p50_ms']:.2f} ms, "
            f"over-budget ExpectDelta p50 {latency['expect_delta_refused']['p50_ms']:.2f} ms, "
            f"health p50 {latency['health']['p50_ms']:.2f} ms",
            file=sys.stderr,
        )
    tag = "cpu" + ("_small" if args.small else "") + (f"_{args.tag}" if args.tag else "")
    write_json(
        args.out,
        f"routing_{tag}",
        {
            "benchmark": "routing",
            "model": dataclasses.asdict(m),
            "runs": runs,
            "eviction_sequential": eviction,
            "router_calls": latency,
        },
    )


if __name__ == "__main__":
    main()
