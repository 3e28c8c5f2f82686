"""Helpers for the end-to-end delta-transfer tests (CPU: shm pools, loopback or NIXL/UCX).

Pools are filled with random bytes (destination pools too, so a write outside the named
pages shows as a changed canary page). Head-sliced checks view a pool's raw page bytes as::

    [num_pages, page_size, local_heads, head_dim * itemsize]      (MHA, NHD per page)

and compare against a "global" pool holding every head, from which each TP rank's pool
was cut (``fill_tp``).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from google.protobuf.json_format import MessageToDict
from kvservice_client import Client, Layout, ShmKVPool, TransferStatus

TERMINAL = ("DONE", "FAILED", "ABORTED")


# -- pool bytes ------------------------------------------------------------------------------
def fused_pair(pair: tuple[Any, Any]) -> bool:
    """Whether transfers between the pair's services take the fused route (see conftest.pair)."""
    return pair[0] is pair[1] or pair[0].app.node.config.same_host_route == "auto"


def regions_of(pool: ShmKVPool) -> list[np.ndarray]:
    """Every KV region view ``[num_pages, page_bytes]`` (K layers, then V layers)."""
    lay = pool.layout
    return [pool.k(i) for i in range(lay.num_layers)] + [pool.v(i) for i in range(lay.num_v_regions)]


def fill_random(pool: ShmKVPool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for r in regions_of(pool):
        r[:] = rng.integers(0, 256, r.shape, dtype=np.uint8)
    for name in getattr(pool, "_aux", {}):
        a = pool.aux(name)
        a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)


def snapshot(pool: ShmKVPool) -> list[np.ndarray]:
    snap = [r.copy() for r in regions_of(pool)]
    snap += [pool.aux(n).copy() for n in getattr(pool, "_aux", {})]
    return snap


def assert_unchanged(pool: ShmKVPool, snap: list[np.ndarray], except_pages: Sequence[int] = ()) -> None:
    """Every page outside ``except_pages`` (and every aux row) equals the snapshot."""
    now = snapshot(pool)
    keep = np.ones(pool.layout.num_pages, dtype=bool)
    keep[np.asarray(except_pages, dtype=np.int64)] = False
    nkv = len(regions_of(pool))
    for i, (a, b) in enumerate(zip(now, snap, strict=True)):
        if i < nkv:
            bad = np.flatnonzero(keep & (a != b).any(axis=1))
            assert bad.size == 0, f"region {i}: pages {bad.tolist()} changed outside the named pages"
        else:
            assert np.array_equal(a, b), "aux rows changed"


def assert_pages_equal(
    dst: ShmKVPool, dst_pages: Sequence[int], src: ShmKVPool, src_pages: Sequence[int]
) -> None:
    d, s = np.asarray(dst_pages, dtype=np.int64), np.asarray(src_pages, dtype=np.int64)
    assert d.size == s.size
    for i, (a, b) in enumerate(zip(regions_of(dst), regions_of(src), strict=True)):
        diff = np.flatnonzero((a[d] != b[s]).any(axis=1))
        assert diff.size == 0, f"region {i}: dst pages {d[diff].tolist()} differ from src {s[diff].tolist()}"


def heads_view(region: np.ndarray, lay: Layout, v: bool = False) -> np.ndarray:
    hd = (lay.head_dim_v if v else lay.head_dim_k) * lay.itemsize
    return region.reshape(lay.num_pages, lay.page_size, lay.local_kv_heads, hd)


def rank_heads(total: int, tp: int, rank: int) -> np.ndarray:
    """Global heads held by ``rank`` (SGLang split; one replicated head when tp > total)."""
    if tp <= total:
        n = total // tp
        return np.arange(rank * n, (rank + 1) * n)
    return np.array([rank * total // tp])


def global_kv(lay: Layout, seed: int) -> list[np.ndarray]:
    """Random 'all heads' KV: per region ``[num_pages, page_size, H, head_dim*itemsize]``."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(lay.num_layers * (2 if lay.kind == "mha" else 1)):
        hd = (lay.head_dim_v if i >= lay.num_layers else lay.head_dim_k) * lay.itemsize
        out.append(
            rng.integers(0, 256, (lay.num_pages, lay.page_size, lay.total_kv_heads, hd), dtype=np.uint8)
        )
    return out


def fill_tp(pool: ShmKVPool, glob: list[np.ndarray]) -> None:
    """Cut this rank's heads out of the global KV into its pool."""
    lay = pool.layout
    heads = rank_heads(lay.total_kv_heads, lay.tp_size, lay.tp_rank)
    for i, r in enumerate(regions_of(pool)):
        heads_view(r, lay, v=i >= lay.num_layers)[:] = glob[i][:, :, heads, :]


def assert_tp_pages(
    pool: ShmKVPool, dst_pages: Sequence[int], glob: list[np.ndarray], src_pages: Sequence[int]
) -> None:
    """Receiver rank's ``dst_pages`` hold exactly its heads of the global ``src_pages``."""
    lay = pool.layout
    heads = rank_heads(lay.total_kv_heads, lay.tp_size, lay.tp_rank)
    d, s = np.asarray(dst_pages), np.asarray(src_pages)
    for i, r in enumerate(regions_of(pool)):
        got = heads_view(r, lay, v=i >= lay.num_layers)[d]
        want = glob[i][s][:, :, heads, :]
        for h in range(len(heads)):
            assert np.array_equal(got[:, :, h], want[:, :, h]), (
                f"rank {lay.tp_rank}/{lay.tp_size} region {i}: local head {h} (global {heads[h]}) wrong"
            )


# -- statuses --------------------------------------------------------------------------------
def wait_all(client: Client, tid: str, n: int = 1, timeout: float = 10.0) -> list[TransferStatus]:
    """Poll until ``n`` records of ``tid`` on this client are terminal (bounded)."""
    end = time.monotonic() + timeout
    while True:
        sts = client.poll([tid])
        if len(sts) >= n and all(s.terminal for s in sts):
            return sts
        if time.monotonic() > end:
            raise AssertionError(f"{tid}: not terminal within {timeout}s: {sts}")
        time.sleep(0.01)


def one(client: Client, tid: str, timeout: float = 10.0) -> TransferStatus:
    sts = wait_all(client, tid, 1, timeout)
    assert len(sts) == 1, sts
    return sts[0]


def eventually(pred: Callable[[], Any], timeout: float = 5.0, what: str = "") -> Any:
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"not true within {timeout}s: {what}")
        time.sleep(0.01)


# -- service processes (python -m kvservice, NIXL) -------------------------------------------
# End-to-end integrity is on in tests (issue 33), as for in-process services (service_thread.py);
# its default (off) stays what benchmarks and production run.
SERVICE_MODULE = (sys.executable, "-m", "kvservice")


class ServiceProc:
    """A ``python -m kvservice`` process on a Unix socket in a fresh temporary directory
    (``netns``: run it in that network namespace; ``env``: extra environment; ``integrity``:
    transfer_integrity on (the tests' default) or off, None: as the environment says (the
    service's default: benchmarks); ``launcher``: the command in place of ``python -m kvservice``,
    e.g. ``faulty_service.py``)."""

    def __init__(
        self,
        name: str,
        *args: str,
        netns: str = "",
        env: dict[str, str] | None = None,
        integrity: bool | None = True,
        launcher: Sequence[str] = SERVICE_MODULE,
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"kvs-e2e-{name}-")
        self.sock = os.path.join(self.dir, "kv.sock")
        self.address = f"unix:{self.sock}"
        self.log = open(os.path.join(self.dir, "log"), "w+b")
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.argv = [
            *prefix,
            *launcher,
            "--uds-path",
            self.sock,
            "--log-format",
            "text",
            "--log-level",
            "WARNING",
            *args,
        ]
        chosen = {} if integrity is None else {"KVSERVICE_TRANSFER_INTEGRITY": "1" if integrity else "0"}
        self.env = {**os.environ, **chosen, **(env or {})}
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)

    def restart(self) -> None:
        """SIGKILL the process and start it again on the same socket (a crashed, restarted service)."""
        self.kill()
        self.proc = self._start()
        self.wait_ready()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_ready(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not _answers(self.sock):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvservice exited {self.proc.returncode}: {self.output()}")
            if time.monotonic() > end:
                raise RuntimeError(f"kvservice not up within {timeout}s: {self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def admin_stats(address: str) -> Any:
    """GetStats as an admin session (this test runs as the service's uid): buffer sets of every
    session are listed (a call without a session lists none). ``sessions`` counts this one too."""
    with Client(address, client_name="admin-stats", timeout=5) as kv:
        assert kv.session_id
        return kv.get_stats()


def _answers(sock: str) -> bool:
    """The service's socket exists and accepts (a killed one's file may still be there)."""
    if not os.path.exists(sock):
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(sock)
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MeteredService(ServiceProc):
    """A service process with /metrics on a free port; :meth:`moved` reads its transfer counters."""

    COUNTERS = ("bytes", "pages_sent", "pages_skipped", "skipped_bytes")

    def __init__(self, name: str, *args: str, **kw: Any) -> None:
        self.metrics_port = free_port()
        super().__init__(name, "--metrics-port", str(self.metrics_port), *args, **kw)

    def moved(self, role: str = "receiver") -> dict[str, float]:
        """``kvservice_transfer_{bytes,pages_sent,pages_skipped,skipped_bytes}_total`` of ``role``
        (one scrape)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        wanted = {f"kvservice_transfer_{k}_total": k for k in self.COUNTERS}
        out = {
            wanted[smp.name]: float(smp.value)
            for fam in text_string_to_metric_families(text)
            for smp in fam.samples
            if smp.name in wanted and smp.labels.get("role") == role
        }
        missing = set(self.COUNTERS) - set(out)
        if missing:
            raise AssertionError(f"{sorted(missing)} not in /metrics")
        return out

    def sums(self, *names: str) -> dict[str, float]:
        """Each sample name's value summed over its labels (0 when absent), one scrape."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        out = dict.fromkeys(names, 0.0)
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name in out:
                    out[smp.name] += float(smp.value)
        return out


# -- engine processes ------------------------------------------------------------------------
def _engine_main(conn: Any, address: str, layout: Layout, aux: dict[str, tuple[int, int]], seed: int) -> None:
    """An engine: owns a shm KV pool, registers it, runs client calls the test sends it."""
    pool = ShmKVPool.create(layout, aux=aux)
    try:
        fill_random(pool, seed)
        with Client(address, client_name="e2e-engine", timeout=15) as kv:
            reg = kv.register_buffers(layout, pool.k_regions, pool.v_regions, pool.aux_specs)
            conn.send((reg.buffer_set_id, pool.name))
            while True:
                msg = conn.recv()
                if msg is None:
                    break
                method, args, kwargs = msg
                try:
                    res = getattr(kv, method)(*args, **kwargs)
                    if hasattr(res, "DESCRIPTOR"):  # protobuf replies travel as dicts
                        res = MessageToDict(res, preserving_proto_field_name=True)
                    conn.send(("ok", res))
                except Exception as exc:  # handed back to the test as data
                    conn.send(("err", type(exc).__name__, str(exc)))
    finally:
        pool.close()
        conn.close()


class _Mapped:
    """An engine's shm object mapped by path: unlike SharedMemory, never seen by the resource
    tracker (which the spawned engines share with us and would otherwise double-unregister)."""

    def __init__(self, name: str) -> None:
        fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mm)
        self.name = name

    def close(self) -> None:
        try:
            self.buf.release()
            self._mm.close()
        except BufferError:  # a view is still alive; the mapping goes with the process
            pass


class EngineError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class EngineProc:
    """Handle on an engine process; ``pool`` is the test's own mapping of its KV pool."""

    def __init__(
        self, address: str, layout: Layout, aux: dict[str, tuple[int, int]] | None = None, seed: int = 0
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.layout = layout
        self.aux = aux or {}
        self.proc = ctx.Process(
            target=_engine_main, args=(child, address, layout, self.aux, seed), daemon=True
        )
        self.proc.start()
        child.close()
        self.pool: ShmKVPool | None = None
        self.bs = ""

    def ready(self, timeout: float = 30.0) -> EngineProc:
        if not self._conn.poll(timeout):
            raise RuntimeError("engine process did not register in time")
        self.bs, name = self._conn.recv()
        self.pool = ShmKVPool(self.layout, _Mapped(name), self.aux, owner=False)  # type: ignore[arg-type]
        return self

    def call(self, method: str, *args: Any, timeout: float = 30.0, **kwargs: Any) -> Any:
        self._conn.send((method, args, kwargs))
        if not self._conn.poll(timeout):
            raise RuntimeError(f"engine call {method} hung")
        r = self._conn.recv()
        if r[0] == "err":
            raise EngineError(r[1], r[2])
        return r[1]

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
