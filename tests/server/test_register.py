"""RegisterBuffers over real shared memory: success, every validation error, ownership."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kvservice_client import (
    Client,
    InvalidArgument,
    Layout,
    NotFound,
    PermissionDenied,
    ShmKVPool,
    Unauthenticated,
    shm_region,
)
from kvservice_client._proto import kvservice_pb2, kvservice_pb2_grpc

from tests.support.poll import eventually

LAYOUT = Layout.mha(num_layers=3, page_size=4, num_pages=10, total_kv_heads=4, head_dim=8, dtype="float16")


@pytest.fixture
def pool():
    p = ShmKVPool.create(LAYOUT, aux={"meta": (32, 8)})
    yield p
    p.close()


def _counts(server) -> tuple[int, int]:
    return len(server.node.buffers), server.node.buffers.importer.open_mappings


def test_register_shm_pool_maps_the_engine_memory(server, pool) -> None:
    """After registration the service's view of a page is the engine's bytes (both directions)."""
    with Client(server.address) as kv:
        reg = kv.register_buffers(pool.layout, pool.k_regions, pool.v_regions, pool.aux_specs, engine_id="e0")
        assert reg.page_bytes_k == 4 * 4 * 8 * 2
        bs = server.node.buffers.get(reg.buffer_set_id)
        pool.v(2)[7] = np.arange(reg.page_bytes_v, dtype=np.uint8)
        assert bytes(bs.v[2].pages(reg.page_bytes_v)[7].numpy()) == bytes(pool.v(2)[7])
        bs.k[1].pages(reg.page_bytes_k)[3].fill_(0xAB)
        assert (pool.k(1)[3] == 0xAB).all() and (pool.k(1)[2] == 0).all()
        assert bs.aux[0].name == "meta" and bs.aux[0].num_rows == 8
        stats = kv.get_stats()
        assert [b.buffer_set_id for b in stats.buffer_sets] == [reg.buffer_set_id]


def _request(pool: ShmKVPool, **layout_changes: object) -> kvservice_pb2.RegisterBuffersRequest:
    layout = dataclasses.replace(pool.layout, **layout_changes)
    return kvservice_pb2.RegisterBuffersRequest(
        layout=layout.to_proto(),
        k_regions=[r.to_proto() for r in pool.k_regions],
        v_regions=[r.to_proto() for r in pool.v_regions],
        aux_regions=[a.to_proto() for a in pool.aux_specs],
    )


def _mutations(pool: ShmKVPool) -> list[tuple[str, kvservice_pb2.RegisterBuffersRequest]]:
    cases = []
    for field, changes in [
        ("layout.kind", {"kind": ""}),
        ("layout.dtype", {"dtype": ""}),
        ("layout.num_layers", {"num_layers": 0}),
        ("layout.page_size", {"page_size": 0}),
        ("layout.num_pages", {"num_pages": 0}),
        ("layout.tp_size", {"tp_size": 0}),
        ("layout.tp_rank", {"tp_rank": 1}),
        ("layout.head_dim_k", {"head_dim_k": 0}),
        ("layout.head_dim_v", {"head_dim_v": 0}),
        ("layout.total_kv_heads", {"total_kv_heads": 3, "tp_size": 2, "local_kv_heads": 1}),
        ("layout.tp_size", {"tp_size": 6, "local_kv_heads": 1}),
        ("layout.local_kv_heads", {"local_kv_heads": 3}),
        ("k_regions", {"num_layers": 2}),
        ("k_regions[0].size_bytes", {"num_pages": 11}),
        ("layout.head_dim_v", {"kind": "mla", "total_kv_heads": 1, "local_kv_heads": 1}),
    ]:
        cases.append((field, _request(pool, **changes)))
    r = _request(pool)
    del r.v_regions[-1]
    cases.append(("v_regions", r))
    r = _request(pool)
    r.v_regions[1].size_bytes += 1
    cases.append(("v_regions[1].size_bytes", r))
    r = _request(pool)
    r.k_regions[2].shm.name = "/no-such-shm-object"
    cases.append(("k_regions[2].shm.name", r))
    r = _request(pool)
    r.k_regions[0].shm.name = "../../etc/passwd"
    cases.append(("k_regions[0].shm.name", r))
    r = _request(pool)
    r.k_regions[2].shm.offset = pool.nbytes
    cases.append(("k_regions[2].size_bytes", r))
    r = _request(pool)
    r.k_regions[1].ClearField("shm")
    cases.append(("k_regions[1].memory", r))
    r = _request(pool)
    r.aux_regions[0].row_bytes = 16
    cases.append(("aux_regions[0].region.size_bytes", r))
    r = _request(pool)
    r.aux_regions.append(r.aux_regions[0])
    cases.append(("aux_regions[1].name", r))
    r = _request(pool)
    r.ClearField("layout")
    cases.append(("layout", r))
    return cases


def test_every_validation_error_names_its_field_and_changes_nothing(server, pool) -> None:
    """Each malformed registration is INVALID_ARGUMENT naming the field; no buffer set or mapping stays."""
    with Client(server.address) as kv:
        sid = kv.session_id
        stub = kvservice_pb2_grpc.KVServiceStub(kv._channel)
        before = _counts(server)
        for field, req in _mutations(pool):
            with pytest.raises(Exception) as info:
                stub.RegisterBuffers(req, metadata=(("kvservice-session", sid),), timeout=10)
            assert info.value.code().name == "INVALID_ARGUMENT", (field, info.value.details())
            assert info.value.details().startswith(field + ":"), (field, info.value.details())
            assert _counts(server) == before, field


def test_mla_layout_registers_without_v_regions(server) -> None:
    """An MLA pool has one latent region per layer and no V regions."""
    layout = Layout.mla(num_layers=2, page_size=1, num_pages=5, latent_dim=576, dtype="bfloat16")
    with ShmKVPool.create(layout) as p, Client(server.address) as kv:
        reg = kv.register_buffers(layout, p.k_regions, p.v_regions)
        assert reg.page_bytes_k == 576 * 2 and reg.page_bytes_v == 0


def test_calls_without_a_session_are_unauthenticated(server, pool) -> None:
    """A call that needs ownership but carries no session id is refused."""
    with Client(server.address) as kv:
        stub = kvservice_pb2_grpc.KVServiceStub(kv._channel)
        with pytest.raises(Exception) as info:
            stub.RegisterBuffers(_request(pool), timeout=5)
        assert info.value.code().name == "UNAUTHENTICATED"
        with pytest.raises(Unauthenticated):
            from kvservice_client._errors import map_rpc_error

            raise map_rpc_error(info.value)


def test_another_session_can_neither_use_nor_drop_a_buffer_set(server, pool) -> None:
    """Ownership: only the registering client's session may unregister its buffer set."""
    with Client(server.address) as owner, Client(server.address) as other:
        reg = owner.register_buffers(pool.layout, pool.k_regions, pool.v_regions)
        with pytest.raises(PermissionDenied, match="another client"):
            other.unregister_buffers(reg.buffer_set_id)
        assert len(server.node.buffers) == 1
        owner.unregister_buffers(reg.buffer_set_id)
        assert _counts(server) == (0, 0)
        with pytest.raises(NotFound):
            owner.unregister_buffers(reg.buffer_set_id)


def test_closing_the_client_releases_its_buffer_sets(server, pool) -> None:
    """When the owner's session ends, its registrations and mappings are released."""
    kv = Client(server.address)
    kv.register_buffers(pool.layout, pool.k_regions, pool.v_regions)
    kv.register_buffers(pool.layout, pool.k_regions, pool.v_regions)
    assert _counts(server) == (2, 1)
    kv.close()
    eventually(lambda: _counts(server) == (0, 0))


def test_owner_process_death_releases_its_buffer_sets(server, pool) -> None:
    """A client process killed with SIGKILL loses its registrations (stream breaks)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys, time
        from kvservice_client import Client, Layout, ShmKVPool
        layout = {pool.layout!r}
        p = ShmKVPool.attach({pool.name!r}, layout, {{"meta": (32, 8)}})
        kv = Client({server.address!r})
        kv.register_buffers(layout, p.k_regions, p.v_regions)
        print("registered", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
        assert len(server.node.buffers) == 1
        proc.kill()
        eventually(lambda: _counts(server) == (0, 0))
    finally:
        proc.kill()


def test_unknown_buffer_set_is_not_found(server) -> None:
    """Unregistering an unknown id is NOT_FOUND; an empty id is INVALID_ARGUMENT."""
    with Client(server.address) as kv:
        with pytest.raises(NotFound):
            kv.unregister_buffers("bs-nope")
        with pytest.raises(InvalidArgument, match="buffer_set_id"):
            kv.unregister_buffers("")


def test_shm_region_helper_round_trips() -> None:
    """shm_region builds the proto form the service reads."""
    pb = shm_region("/x", 128, 64).to_proto()
    assert (pb.shm.name, pb.shm.offset, pb.size_bytes) == ("/x", 64, 128)
