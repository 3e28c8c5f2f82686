"""Fuzzing every engine and peer RPC (hypothesis): random, boundary and malformed requests,
raw undecodable bytes included, against one service holding real pools.

After every method's batch: the service answers health, a real transfer still verifies byte
for byte, and no byte of the pools' shared memory outside the regions the engine registered
changed (each registered layer sits between canary pages). No caller's mistake may come back
INTERNAL or UNKNOWN. ``KVS_FUZZ_EXAMPLES`` sets examples per method (CI: a bounded number;
e.g. ``KVS_FUZZ_EXAMPLES=5000 pytest --timeout=0 tests/server/test_fuzz.py`` for a long run;
streaming RPCs wait out a 0.5 s deadline per example, so a long run outlasts the 300 s default).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvservice_client import Client, Layout, ShmKVPool, shm_region
from kvservice_client._proto import kvservice_pb2, peer_pb2, peer_pb2_grpc

from kvservice.identity import Identity

EXAMPLES = int(os.environ.get("KVS_FUZZ_EXAMPLES", "40"))
N = 16  # registered pages per layer
BIG = Layout.mha(num_layers=2, page_size=4, num_pages=N + 2, total_kv_heads=2, head_dim=8, dtype="float16")
LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=N, total_kv_heads=2, head_dim=8, dtype="float16")
SERVICES = {
    "KVService": kvservice_pb2.DESCRIPTOR.services_by_name["KVService"],
    "KVPeer": peer_pb2.DESCRIPTOR.services_by_name["KVPeer"],
}
METHODS = [(s, m) for s, d in SERVICES.items() for m in d.methods]
SENDER = "fuzz-sender"
CALLER_MISTAKE_NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class Guarded:
    """A pool whose registered regions each sit one page inside the shm object: the page before
    and after every layer, the alignment gaps and everything else are canaries."""

    def __init__(self, seed: int) -> None:
        self.pool = ShmKVPool.create(BIG)
        self.buf = np.ndarray((self.pool.nbytes,), np.uint8, buffer=self.pool._shm.buf)
        self.buf[:] = np.random.default_rng(seed).integers(0, 256, self.buf.size, dtype=np.uint8)
        pb = LAYOUT.page_bytes_k
        self.k = [shm_region(r.shm_name, N * pb, r.offset + pb) for r in self.pool.k_regions]
        self.v = [shm_region(r.shm_name, N * pb, r.offset + pb) for r in self.pool.v_regions]
        self.outside = np.ones(self.buf.size, bool)
        for r in self.k + self.v:
            self.outside[r.offset : r.offset + r.size_bytes] = False
        self.canary = self.buf[self.outside].copy()

    def page(self, layer: int, page: int) -> np.ndarray:
        r = self.k[layer]
        pb = LAYOUT.page_bytes_k
        return self.buf[r.offset + page * pb : r.offset + (page + 1) * pb]

    def canaries_intact(self) -> bool:
        return bool(np.array_equal(self.buf[self.outside], self.canary))


class Rig:
    def __init__(self, server: Any) -> None:
        self.server = server
        self.src, self.dst = Guarded(1), Guarded(2)
        self.a = Client(server.address, client_name="fuzz-a", timeout=5)
        self.b = Client(server.address, client_name="fuzz-b", timeout=5)
        self.bs_a = self.a.register_buffers(LAYOUT, self.src.k, self.src.v).buffer_set_id
        self.bs_b = self.b.register_buffers(LAYOUT, self.dst.k, self.dst.v).buffer_set_id
        self.channel = grpc.insecure_channel(server.address)
        self.ids = [self.bs_a, self.bs_b, "", "x" * 300, "bs-0", "t-live", "\u00e9\u0000"]
        self.verified = 0

    def close(self) -> None:
        self.channel.close()
        self.a.close()
        self.b.close()
        self.src.pool.close()
        self.dst.pool.close()

    def healthy_and_correct(self) -> None:
        """Health, a real transfer byte for byte, canaries intact."""
        with grpc.insecure_channel(self.server.address) as ch:
            st_ = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert st_ == health_pb2.HealthCheckResponse.SERVING
        tid = f"verify-{uuid.uuid4().hex[:8]}"
        src, dst = [3, 0, 15], [7, 9, 1]
        self.b.expect_delta(tid, self.bs_b, prefix_pages=0, dst_page_indices=dst)
        self.a.send_delta(tid, self.bs_a, src_page_indices=src, peer_address=self.server.app.peer_address)
        for kv in (self.a, self.b):
            (status,) = kv.wait(tid, timeout=10)
            assert status.state == "DONE", status
        for s, d in zip(src, dst, strict=True):
            for layer in range(LAYOUT.num_layers):
                assert np.array_equal(self.dst.page(layer, d), self.src.page(layer, s))
        assert self.src.canaries_intact() and self.dst.canaries_intact()
        self.verified += 1


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    from tests.support.services import ServerThread, make_config

    server = ServerThread(
        make_config(
            transport="loopback", same_host_route="off", max_deadline_ms=5_000, default_deadline_ms=5_000
        )
    )
    r = Rig(server)
    yield r
    r.close()
    server.stop()


# -- strategies built from the message descriptors --------------------------------------------
INTS = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(fd: Any, ids: list[str]) -> st.SearchStrategy[Any]:
    if fd.type in INTS:
        lo, hi = INTS[fd.type]
        edges = [
            v for v in (0, 1, 2, 3, N - 1, N, N + 1, 4096, hi, lo, 2**31 - 1, 2**32 - 1) if lo <= v <= hi
        ]
        return st.one_of(st.sampled_from(edges), st.integers(max(lo, -2), 2 * N), st.integers(lo, hi))
    if fd.type == FD.TYPE_BOOL:
        return st.booleans()
    if fd.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return st.floats(allow_nan=True, width=32 if fd.type == FD.TYPE_FLOAT else 64)
    if fd.type == FD.TYPE_STRING:
        likely = [i for i in ids if _likely(fd.name, i)]  # real ids where the field wants one
        if likely:
            return st.one_of(*[st.sampled_from(likely)] * 3, st.sampled_from(ids), st.text(max_size=40))
        return st.one_of(st.sampled_from(ids), st.text(max_size=40))
    if fd.type == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if fd.type == FD.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in fd.enum_type.values]), st.integers(-3, 100))
    raise AssertionError(fd.type)


def _likely(field: str, value: str) -> bool:
    if "sender_service_id" in field:
        return value == SENDER
    if "transfer_id" in field:
        return value.startswith("t-live")
    if "buffer_set" in field:
        return value.startswith("bs-") and value != "bs-0"
    return False


@st.composite
def message(draw: Any, descriptor: Any, ids: list[str], depth: int = 0) -> Any:
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(descriptor)()
    for fd in descriptor.fields:
        wants_id = any(_likely(fd.name, i) for i in ids)
        if draw(st.integers(0, 7)) >= (7 if wants_id else 4):  # id fields: mostly set
            continue
        repeated = getattr(fd, "is_repeated", None)
        repeated = fd.label == FD.LABEL_REPEATED if repeated is None else repeated
        if fd.message_type is not None:
            if depth >= 3:
                continue
            if fd.message_type.GetOptions().map_entry:
                continue
            sub = message(fd.message_type, ids, depth + 1)
            if repeated:
                getattr(msg, fd.name).extend(draw(st.lists(sub, max_size=3)))
            else:
                getattr(msg, fd.name).CopyFrom(draw(sub))
        elif repeated:
            getattr(msg, fd.name).extend(draw(st.lists(_scalar(fd, ids), max_size=8)))
        else:
            try:
                setattr(msg, fd.name, draw(_scalar(fd, ids)))
            except (ValueError, TypeError):
                pass  # e.g. an unknown enum number on a closed enum
    return msg


def _call(
    rig: Rig, service: str, method: Any, payload: bytes, metadata: list[tuple[str, str]]
) -> grpc.StatusCode:
    path = f"/{SERVICES[service].full_name}/{method.name}"
    ident = lambda b: b  # noqa: E731  (raw bytes both ways)
    try:
        if method.client_streaming:
            call = rig.channel.stream_stream(path, request_serializer=ident, response_deserializer=ident)
            for _ in call(iter([payload, payload]), timeout=1.0, metadata=metadata):
                pass
        elif method.server_streaming:
            call = rig.channel.unary_stream(path, request_serializer=ident, response_deserializer=ident)
            for _ in call(payload, timeout=0.5, metadata=metadata):
                pass
        else:
            rig.channel.unary_unary(path, request_serializer=ident, response_deserializer=ident)(
                payload, timeout=3.0, metadata=metadata
            )
    except grpc.RpcError as exc:
        if os.environ.get("KVS_FUZZ_DEBUG"):
            print(method.name, exc.code().name, (exc.details() or "")[:150])
        return exc.code()
    return grpc.StatusCode.OK


def _peer_credential(rig: Rig) -> list[tuple[str, str]]:
    """KVPeer on the socket is for a co-located kvservice: the service's own uid."""
    me = Identity(os.getuid(), os.getgid(), os.getpid())
    return [("kvservice-credential", rig.server.node.credentials.issue(me))]


def _metadata(rig: Rig, draw: Any) -> list[tuple[str, str]]:
    session = draw(st.sampled_from([rig.a.session_id, rig.b.session_id, "", "no-such-session"]))
    md = [("kvservice-request-id", uuid.uuid4().hex)]
    return md + ([("kvservice-session", session)] if session else [])


@pytest.mark.parametrize(("service", "name"), [(s, m.name) for s, m in METHODS])
def test_random_and_malformed_requests(rig: Rig, service: str, name: str) -> None:
    method = SERVICES[service].methods_by_name[name]
    if name == "CloseSession" or (service == "KVService" and name == "UnregisterBuffers"):
        ids = [i for i in rig.ids if not i.startswith("bs-") or i == "bs-0"]  # keep the rig's own
    else:
        ids = rig.ids
    seen: dict[str, int] = {}
    ticket = ""
    if service == "KVPeer":
        # a live declaration whose plan a "fuzz-sender" fetched, so random peer calls naming them
        # reach the staging and unpack paths that write into the pool
        tid = f"t-live-{name}"
        rig.b.expect_delta(tid, rig.bs_b, prefix_pages=0, dst_page_indices=range(8))
        got = peer_pb2_grpc.KVPeerStub(rig.channel).GetReceivePlan(
            peer_pb2.GetReceivePlanRequest(
                transfer_id=tid, src_layout=LAYOUT.to_proto(), sender_service_id=SENDER, wait_ms=1000
            ),
            timeout=5,
            metadata=_peer_credential(rig),
        )
        ticket = got.plans[0].sender_ticket
        ids = [*ids, tid, SENDER]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(data=st.data())
    def run(data: Any) -> None:
        if data.draw(st.integers(0, 4)) == 0:  # raw bytes: most do not decode
            payload = data.draw(st.binary(min_size=1, max_size=128))
        else:
            msg = data.draw(message(method.input_type, ids))
            if service == "KVPeer" and data.draw(st.booleans()):  # aim at the live transfer
                for field, value in (
                    ("transfer_id", ids[-2]),
                    ("dst_buffer_set_id", rig.bs_b),
                    ("sender_service_id", SENDER),
                    ("sender_ticket", ticket),
                ):
                    if field in method.input_type.fields_by_name:
                        setattr(msg, field, value)
            payload = msg.SerializeToString()
        metadata = _metadata(rig, data.draw)
        if service == "KVPeer" and data.draw(st.integers(0, 7)):  # mostly a co-located service
            metadata = [(k, v) for k, v in metadata if k != "kvservice-session"] + _peer_credential(rig)
        if name == "CloseSession":
            metadata = [(k, v) for k, v in metadata if k != "kvservice-session"]  # keep the rig's
        code = _call(rig, service, method, payload, metadata)
        seen[code.name] = seen.get(code.name, 0) + 1
        assert code not in CALLER_MISTAKE_NEVER, f"{service}.{name} answered {code.name}"

    run()
    rig.healthy_and_correct()
    print(f"{service}.{name}: {sorted(seen.items())}")
    assert sum(seen.values()) >= EXAMPLES, seen
