"""The adapters name the prefill's kvservice in the decode's ExpectDelta (``sender_address``),
so its service fills ``allowed_senders`` and a third party cannot fetch the plan first.
A prefill configured with no peer address names what its service says it is (``SessionEvent.
peer_address``, the SDK's ``service_peer_address``); a configured one wins.

Three in-process services over mutual TLS, one cluster CA: the prefill's (``prefill-a``), another
member's (``prefill-c``, the third party) and the decode's (``decode-b``). Each adapter's decode
side declares through its own code (kvservice_vllm's WorkerSide jobs, kvservice_sglang's receiver
over SGLang's base classes or the stand-in); the third party's SendDelta is refused before any
byte moves, and the prefill then delivers byte-exact. Neither engine package is needed.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "vllm"))
sys.path.insert(0, str(ROOT / "clients" / "sglang"))
from kvservice_client import AsyncClient  # noqa: E402
from kvservice_vllm.jobs import ClaimJob, LandJob  # noqa: E402

from tests.support import sglang_stub  # noqa: E402
from tests.support.engine_pools import DEADLINE_MS, EnginePool, Spec, step  # noqa: E402
from tests.support.pki import CA, mtls_peer  # noqa: E402
from tests.support.poll import eventually  # noqa: E402
from tests.support.sglang_pools import Pools, manager  # noqa: E402

SPEC = Spec("vllm", "nhc", 16, 12)
SRC, DST = [3, 7, 1, 10, 5], [9, 0, 4, 11, 2]
TOKENS = len(SRC) * SPEC.page


@pytest.fixture
def mtls(make_server: Any, tmp_path: Any) -> dict[str, Any]:
    """The prefill's service ``a``, a third party's ``c``, the decode's ``b``: peers over mutual TLS."""
    ca = CA(str(tmp_path), "cluster")

    def service(name: str) -> Any:
        return make_server(transport="loopback", same_host_route="off", **mtls_peer(ca, name))

    return {"a": service("prefill-a"), "c": service("prefill-c"), "b": service("decode-b")}


@pytest.fixture(scope="module")
def sgl() -> Any:
    """kvservice_sglang.conn over the real SGLang if installed, else over the stand-in (removed after)."""
    with sglang_stub.backend_conn() as c:
        yield c


_VLLM_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@pytest.fixture
def vllm_sched(monkeypatch: Any) -> Any:
    """kvservice_vllm.scheduler over the real vLLM if installed, else over a stand-in for the one
    base class its step metadata derives from (removed after); every prefill ran to max_tokens."""
    added: list[str] = []
    try:
        __import__(_VLLM_BASE)
    except ImportError:
        parts = _VLLM_BASE.split(".")
        for name in (".".join(parts[: i + 1]) for i in range(len(parts))):
            if name not in sys.modules:
                sys.modules[name] = types.ModuleType(name)
                added.append(name)
        sys.modules[_VLLM_BASE].KVConnectorMetadata = type("KVConnectorMetadata", (), {})  # type: ignore[attr-defined]
    import kvservice_vllm.scheduler as sched

    monkeypatch.setattr(sched, "_capped", lambda request: True)
    yield sched
    if added:
        for name in (*added, "kvservice_vllm.scheduler", "kvservice_vllm.meta"):
            sys.modules.pop(name, None)
        for attr in ("scheduler", "meta"):  # the package keeps its submodules as attributes
            vars(sys.modules["kvservice_vllm"]).pop(attr, None)


@pytest.fixture
def calls(monkeypatch: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every ExpectDelta the adapters make through the SDK: (method, its keyword arguments)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    for name in ("expect_delta", "expect_landing"):
        real = getattr(AsyncClient, name)

        async def spy(self: Any, *args: Any, _n: str = name, _real: Any = real, **kw: Any) -> Any:
            seen.append((_n, kw))
            return await _real(self, *args, **kw)

        monkeypatch.setattr(AsyncClient, name, spy)
    return seen


def declared(server: Any, tid: str) -> list[Any]:
    """The decode service's declarations of ``tid`` (every buffer set, landings included)."""
    return server.app.node.transfers.receiver.of(tid)


def _outcome(pool: EnginePool, timeout: float = 30.0) -> Any:
    worker = pool.worker
    assert worker is not None
    return eventually(worker.outcomes, timeout, "an outcome", interval=0.005)[0]


def _rogue_is_refused(rogue: EnginePool, tid: str, peer: str) -> None:
    rogue.send(tid, SRC, peer)
    out = rogue.wait()
    assert not out["ok"] and "allowed_senders" in out["why"], out


# -- vLLM -----------------------------------------------------------------------------------------
def test_vllm_decode_names_the_prefill_and_a_third_party_cannot_fetch_the_plan(mtls, calls) -> None:
    """A RecvJob carrying the prefill's kvservice: ExpectDelta names it, the decode's service allows
    only its certificate's name; the third party is refused, nothing written; the prefill
    delivers byte-exact."""
    a, b, c = mtls["a"], mtls["b"], mtls["c"]
    src, rogue, dst = (EnginePool(SPEC, s.address, "cpu", n) for s, n in ((a, "pa"), (c, "pc"), (b, "db")))
    try:
        for i, pool in enumerate((src, rogue, dst)):
            pool.fill(seed=21 + i)
        before = dst.digests(DST, 0, TOKENS)
        dst.expect("t-v", 0, DST, sender=a.app.peer_address)
        eventually(lambda: declared(b, "t-v"))
        assert (
            calls == [("expect_delta", calls[0][1])] and calls[0][1]["sender_address"] == a.app.peer_address
        )
        assert declared(b, "t-v")[0].allowed_senders == {"prefill-a", "local"}
        _rogue_is_refused(rogue, "t-v", b.app.peer_address)
        assert dst.digests(DST, 0, TOKENS) == before
        src.send("t-v", SRC, b.app.peer_address)
        assert src.wait()["ok"] and dst.wait()["ok"]
        assert dst.digests(DST, 0, TOKENS) == src.digests(SRC, 0, TOKENS)
    finally:
        for pool in (src, rogue, dst):
            pool.close()


@pytest.mark.parametrize("refused", [False, True], ids=["landed", "landing-refused"])
def test_vllm_landing_and_its_fallback_name_the_prefill(mtls, calls, refused: bool) -> None:
    """The landing option: the LandJob's landing names the prefill (or, the pool being full, the
    ClaimJob's direct ExpectDelta does); the third party is refused; the claim is byte-exact."""
    a, b, c = mtls["a"], mtls["b"], mtls["c"]
    if refused:
        b.app.node.transfers.landing.pool.capacity_bytes = 4096  # less than one page of this pool
    src, rogue, dst = (EnginePool(SPEC, s.address, "cpu", n) for s, n in ((a, "pa"), (c, "pc"), (b, "db")))
    sender = a.app.peer_address
    try:
        for i, pool in enumerate((src, rogue, dst)):
            pool.fill(seed=31 + i)
        assert dst.worker is not None
        dst.worker.submit(step(lands=[LandJob("r-l", "t-l", 0, len(DST), DEADLINE_MS, 20_000, sender)]))
        claim = ClaimJob("r-l", "t-l", 0, tuple(DST), DEADLINE_MS, "", sender)
        if refused:  # the landing is refused at once; the claim then receives directly
            dst.worker.submit(step(claims=[claim]))
        eventually(lambda: declared(b, "t-l"))
        want = ["expect_landing", "expect_delta"] if refused else ["expect_landing"]
        assert [n for n, _ in calls] == want and all(kw["sender_address"] == sender for _, kw in calls)
        assert declared(b, "t-l")[0].allowed_senders == {"prefill-a", "local"}
        _rogue_is_refused(rogue, "t-l", b.app.peer_address)
        src.send("t-l", SRC, b.app.peer_address)
        assert src.wait()["ok"]
        if not refused:  # landed: the allocation claims it
            dst.worker.submit(step(claims=[claim]))
        out = _outcome(dst)
        assert out.ok, out
        assert dst.digests(DST, 0, TOKENS) == src.digests(SRC, 0, TOKENS)
    finally:
        for pool in (src, rogue, dst):
            pool.close()


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def _request(rid: str, params: dict[str, Any]) -> Any:
    """What the scheduler side reads of a vLLM Request."""
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(TOKENS)), kv_transfer_params=params)


def test_a_vllm_prefill_without_configuration_names_what_its_service_says(mtls, calls, vllm_sched) -> None:
    """No kvservice_peer_address: the prefill's scheduler side asks its kvservice (off the
    scheduler's thread) and its answer names it as ``kvservice_sender``; the decode's RecvJob
    declares with it, the third party is refused, the prefill's own SendJob delivers byte-exact.
    A configured address wins (no lookup)."""
    a, b, c = mtls["a"], mtls["b"], mtls["c"]
    SchedulerSide = vllm_sched.SchedulerSide  # noqa: N806
    configured = SchedulerSide(
        SPEC.page, DEADLINE_MS, peer_address="10.9.9.9:50052", service_address=a.address
    )
    assert configured.peer_address_known.is_set() and configured.peer_address == "10.9.9.9:50052"
    prefill = SchedulerSide(SPEC.page, DEADLINE_MS, service_address=a.address)
    assert prefill.peer_address_known.wait(20)
    assert prefill.peer_address == a.app.peer_address != a.address  # its peer listener, not the socket
    src, rogue, dst = (EnginePool(SPEC, s.address, "cpu", n) for s, n in ((a, "pa"), (c, "pc"), (b, "db")))
    try:
        for i, pool in enumerate((src, rogue, dst)):
            pool.fill(seed=41 + i)
        before = dst.digests(DST, 0, TOKENS)
        asked = {"do_remote_decode": True, "kvservice_peer": b.app.peer_address, "transfer_id": "t-auto"}
        hold, params = prefill.request_finished(_request("p-auto", asked), SRC)
        assert hold and params is not None and params["kvservice_sender"] == a.app.peer_address
        decode = SchedulerSide(SPEC.page, DEADLINE_MS)
        req = _request("d-auto", dict(params))  # the proxy forwards the prefill's params as they are
        decode.get_num_new_matched_tokens(req, 0)
        decode.update_state_after_alloc(req, _Blocks(DST), TOKENS)
        meta = decode.build_connector_meta()
        assert [j.sender for j in meta.recvs] == [a.app.peer_address]
        assert dst.worker is not None and src.worker is not None
        dst.worker.submit(meta)
        eventually(lambda: declared(b, "t-auto"))
        assert calls[0][1]["sender_address"] == a.app.peer_address
        assert declared(b, "t-auto")[0].allowed_senders == {"prefill-a", "local"}
        _rogue_is_refused(rogue, "t-auto", b.app.peer_address)
        assert dst.digests(DST, 0, TOKENS) == before
        src.worker.submit(prefill.build_connector_meta())  # the prefill's SendJob
        assert src.wait()["ok"] and dst.wait()["ok"]
        assert dst.digests(DST, 0, TOKENS) == src.digests(SRC, 0, TOKENS)
    finally:
        for pool in (src, rogue, dst):
            pool.close()


# -- SGLang ---------------------------------------------------------------------------------------
def _check_bytes(p: Pools, d: Pools, src: np.ndarray, dst: np.ndarray, rows: tuple[int, int]) -> None:
    """The prefill's pages in ``dst``, its aux row in the decode's (no view outlives the call)."""
    got, want = d.snapshot(), p.snapshot()
    n = len(p.bufs)
    for i in range(n):
        np.testing.assert_array_equal(got[i][dst], want[i][src])
    for j in range(len(p.aux)):
        np.testing.assert_array_equal(got[n + j][rows[1]], want[n + j][rows[0]])


@pytest.mark.parametrize(
    "landing,configured",
    [(False, True), (True, True), (False, False)],
    ids=["default", "landing", "unconfigured"],
)
def test_sglang_decode_names_the_prefill_its_bootstrap_server_announces(
    sgl, mtls, calls, monkeypatch, landing: bool, configured: bool
) -> None:
    """The prefill's bootstrap server names its kvservice (GET /service: configured, or what the
    service at SGLANG_KVSERVICE_ADDRESS says); the decode's ExpectDelta (or landing) names it as
    the sender; the third party is refused; the prefill delivers byte-exact, pages and aux row."""
    a, b, c = mtls["a"], mtls["b"], mtls["c"]
    p, d, r = Pools(1), Pools(2), Pools(3)
    if configured:
        server = sgl.KVServiceBootstrapServer("127.0.0.1", 0, peer_address=a.app.peer_address)
    else:  # the prefill's process: its service's address, no peer address
        monkeypatch.delenv("SGLANG_KVSERVICE_PEER_ADDRESS", raising=False)
        monkeypatch.setenv("SGLANG_KVSERVICE_ADDRESS", a.address)
        server = sgl.KVServiceBootstrapServer("127.0.0.1", 0)
    env = {"SGLANG_KVSERVICE_LANDING_TTL_MS": "20000"} if landing else {}
    mp = manager(sgl, monkeypatch, a, "prefill", p, SGLANG_KVSERVICE_BOOTSTRAP_TIMEOUT_S="10")
    md = manager(sgl, monkeypatch, b, "decode", d, **env)
    mr = manager(sgl, monkeypatch, c, "prefill", r)
    addr, room, tid = f"127.0.0.1:{server.port}", 41, "sgl-41"
    src, dst = np.arange(10, 16), np.array([50, 41, 33, 60, 2, 9])
    poll = sgl.KVPoll
    try:
        recv = sgl.KVServiceReceiver(md, addr, room)
        send = sgl.KVServiceSender(mp, addr, room)
        recv.init(0)
        if not landing:
            recv.send_metadata(dst, aux_index=2, decode_prefix_len=0)
        eventually(lambda: send.poll() == poll.WaitingForInput)
        send.init(src.size, aux_index=5)  # landing: posts its page count, the decode declares
        eventually(lambda: declared(b, tid))
        assert [n for n, _ in calls] == ["expect_landing" if landing else "expect_delta"]
        assert calls[0][1]["sender_address"] == a.app.peer_address
        assert declared(b, tid)[0].allowed_senders == {"prefill-a", "local"}
        before = d.snapshot()
        fut = mr.bg.transfer(
            tid,
            lambda kv: kv.send_delta(
                tid,
                mr.buffer_set_id,
                src_page_indices=src,
                peer_address=b.app.peer_address,
                deadline_ms=DEADLINE_MS,
            ),
            DEADLINE_MS,
        )
        st = fut.result(30)
        assert (st.state, st.error_code) == ("FAILED", "PERMISSION_DENIED"), st
        assert all(np.array_equal(x, y) for x, y in zip(d.snapshot(), before, strict=True))
        send.send(src)
        eventually(lambda: send.poll() in (poll.Success, poll.Failed))
        assert send.poll() == poll.Success, send.failed
        if landing:
            recv.send_metadata(dst, aux_index=2, decode_prefix_len=0)
        eventually(lambda: recv.poll() in (poll.Success, poll.Failed))
        assert recv.poll() == poll.Success, recv.failed
        _check_bytes(p, d, src, dst, (5, 2))
    finally:
        for m in (mp, md, mr):
            m.close()
        server.close()
        for pools in (p, d, r):
            pools.close()


def test_the_bootstrap_server_names_the_configured_service_else_what_the_service_says(
    sgl, monkeypatch, make_server, tmp_path
) -> None:
    """GET /service: the configured SGLANG_KVSERVICE_PEER_ADDRESS; else what the local kvservice
    says (its advertise_address here); 404 while no service answers; never set over HTTP."""
    svc = make_server(tcp_address="", advertise_address="10.0.0.7:50052")
    import kvservice_sglang.bootstrap as bootstrap

    monkeypatch.setattr(bootstrap, "_SERVICE_LOOKUP_TIMEOUT_S", 0.5)
    monkeypatch.delenv("SGLANG_KVSERVICE_PEER_ADDRESS", raising=False)
    unset = sgl.KVServiceBootstrapServer("127.0.0.1", 0, service_address=f"unix:{tmp_path}/nobody.sock")
    told = sgl.KVServiceBootstrapServer("127.0.0.1", 0, service_address=svc.address)
    monkeypatch.setenv("SGLANG_KVSERVICE_PEER_ADDRESS", "10.0.0.5:50052")
    named = sgl.KVServiceBootstrapServer("127.0.0.1", 0, service_address=svc.address)
    try:
        assert sgl._http("GET", f"http://127.0.0.1:{unset.port}/service")[0] == 404
        assert sgl._http("GET", f"http://127.0.0.1:{told.port}/service") == (200, {"peer": "10.0.0.7:50052"})
        url = f"http://127.0.0.1:{named.port}/service"
        assert sgl._http("GET", url) == (200, {"peer": "10.0.0.5:50052"})  # the configured one wins
        assert sgl._http("PUT", url, {"peer": "evil:1"})[0] == 400
        assert sgl._http("GET", url) == (200, {"peer": "10.0.0.5:50052"})  # read, not popped
    finally:
        unset.close()
        told.close()
        named.close()
