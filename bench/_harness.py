"""Shared pieces of the end-to-end benchmarks: service processes, KV pools (shm or CUDA),
percentiles, JSON output and optional progress bars.

Every benchmark runs kvservice and its baseline in one run, on the same layout and the same page
indices, and writes one JSON file under ``--out`` (bench/run.py gathers a suite's into
``bench/results/<kind>/<suite>.json``). matplotlib and tqdm are optional: the GPU machine has neither.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients/python")]

from kvservice_client import Layout, ShmKVPool  # noqa: E402

# The bench process's own thread switch interval (the services': KVSERVICE_GIL_SWITCH_US): its
# clients' reader threads hand a lane END or a stream message to the waiting caller under the GIL.
if os.environ.get("BENCH_GIL_SWITCH_US"):
    sys.setswitchinterval(int(os.environ["BENCH_GIL_SWITCH_US"]) * 1e-6)

__all__ = [
    "ROOT",
    "KVPool",
    "Services",
    "gpu_name",
    "progress",
    "summarize",
    "write_json",
]


def progress(it: Iterable[Any], desc: str, total: int | None = None) -> Iterable[Any]:
    """tqdm when installed (on stderr), else the iterable unchanged."""
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, desc=desc, total=total, leave=False, file=sys.stderr, disable=not sys.stderr.isatty())


def summarize(samples_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean/min/max in milliseconds of samples given in seconds."""
    a = np.asarray(samples_s, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"n": 0}
    return {
        "n": int(a.size),
        "p50_ms": float(np.percentile(a, 50)),
        "p90_ms": float(np.percentile(a, 90)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
        "min_ms": float(a.min()),
        "max_ms": float(a.max()),
    }


def gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    return "none"


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except Exception:
        return ""


def write_json(out: str | Path, name: str, report: dict[str, Any]) -> Path:
    """Write ``report`` plus run metadata to ``out/name.json``; return the path."""
    meta = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpu": gpu_name(),
        "commit": _git_commit(),
        "argv": sys.argv,
        "unix_time": time.time(),
        "ucx_tls": os.environ.get("UCX_TLS", "(unset)"),
        "service_env": {k: v for k, v in os.environ.items() if k.startswith("KVSERVICE_")},
        # CUDA's multi-process service: the processes of a run share one GPU context (see operations.md)
        "cuda_mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""),
        "bench_switch_interval_us": round(sys.getswitchinterval() * 1e6),
        "bench_settle_s": float(os.environ.get("BENCH_SETTLE_S", "0")),
    }
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, **report}, indent=2, default=float))
    print(f"wrote {path}", file=sys.stderr)
    return path


PEER_AUTHS = ("local", "token", "mtls", "insecure")


def _free_port() -> int:
    """A loopback TCP port free now (the service binds it a moment later)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Services:
    """``n`` kvservice processes on Unix sockets in a temp dir; terminated (then killed) on exit.

    ``env`` adds ``KVSERVICE_*`` settings, e.g. ``{"KVSERVICE_VRAM_STAGING_MB": "2048"}``.
    ``net`` (``--netns``): service ``i`` runs in namespace ``net.names[i]`` and listens for peers
    on ``net.ips[i]``, UCX over TCP, a peer token between them; engines still reach it over its
    Unix socket. ``peer_addresses[i]`` is what a SendDelta names to reach service ``i``.
    ``peer_auth`` (``--peer-auth``): how the services prove themselves to each other: ``local``
    (peers over their Unix sockets, the default), or KVPeer on a loopback TCP port with a peer
    token (``token``, Helm's default), mutual TLS (``mtls``: certificates of a CA made here,
    needs ``cryptography``) or none (``insecure``).
    """

    PEER_PORT = 7777

    def __init__(
        self,
        n: int = 2,
        env: dict[str, str] | None = None,
        timeout_s: float = 120.0,
        net: Any = None,
        log_dir: Path | None = None,
        peer_auth: str = "local",
    ) -> None:
        if peer_auth not in PEER_AUTHS:
            raise ValueError(f"peer_auth: {peer_auth!r} is not one of {', '.join(PEER_AUTHS)}")
        self.n, self.extra, self.timeout_s, self.net = n, env or {}, timeout_s, net
        self.peer_auth = peer_auth
        self.log_dir = log_dir  # service i's stderr (its log) goes to log_dir/svc<i>.log
        self._logs: list[Any] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []
        self.peer_addresses: list[str] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Services:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvbench-")
        env = {
            **os.environ,
            "KVSERVICE_LOG_FORMAT": "text",
            "KVSERVICE_LOG_LEVEL": os.environ.get("BENCH_SERVICE_LOG_LEVEL", "WARNING"),
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), str(ROOT / "clients/python"), os.environ.get("PYTHONPATH", "")]
            ),
            **self.extra,
        }
        token = Path(self._tmp.name) / "peer-token"
        if self.net is not None:
            from _netns import UCX_TCP_ENV

            token.write_text(os.urandom(16).hex() + "\n")
            env |= UCX_TCP_ENV | {"KVSERVICE_SAME_HOST_ROUTE": "off"}
        try:
            for i in range(self.n):
                sock = Path(self._tmp.name) / f"svc{i}.sock"
                cmd = [sys.executable, "-m", "kvservice", "--uds-path", str(sock)]
                peer = f"unix:{sock}"
                if self.net is not None:
                    peer = f"{self.net.ips[i]}:{self.PEER_PORT}"
                    cmd = ["ip", "netns", "exec", self.net.names[i], *cmd]
                    cmd += ["--peer-tcp-address", peer, "--peer-token-file", str(token)]
                elif self.peer_auth != "local":
                    peer = f"127.0.0.1:{_free_port()}"
                    cmd += ["--peer-tcp-address", peer, *self._auth_flags(i, token)]
                if os.environ.get("BENCH_TORCH_PROFILE_DIR"):  # GPU activity: bench/_profiled.py
                    m = cmd.index("-m")
                    cmd[m : m + 2] = [str(ROOT / "bench/_profiled.py")]
                spy = os.environ.get("BENCH_PYSPY_DIR")
                if spy:  # profile: py-spy samples every thread, idle ones too (collapsed stacks)
                    out = Path(spy) / f"svc{i}-{os.getpid()}.txt"
                    cmd = [
                        "py-spy",
                        "record",
                        "-r",
                        "2000",
                        *os.environ.get("BENCH_PYSPY_FLAGS", "--idle").split(),  # e.g. "--gil"
                        "--threads",
                        "--nonblocking",
                        "-f",
                        "raw",
                        "-o",
                        str(out),
                        "--",
                        *cmd,
                    ]
                err = None
                if self.log_dir is not None:
                    err = open(self.log_dir / f"svc{i}.log", "w")
                    self._logs.append(err)
                self.procs.append(
                    subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=err, start_new_session=bool(spy))
                )
                self.addresses.append(f"unix:{sock}")
                self.peer_addresses.append(peer)
            end = time.monotonic() + self.timeout_s
            for p, a in zip(self.procs, self.addresses, strict=False):
                while not os.path.exists(a[5:]):
                    if p.poll() is not None:
                        raise RuntimeError(f"kvservice exited with {p.returncode} before listening on {a}")
                    if time.monotonic() > end:
                        raise RuntimeError(f"kvservice did not listen on {a} within {self.timeout_s} s")
                    time.sleep(0.05)
            if env.get("KVSERVICE_LANE", "1") not in ("0", "false", "off"):  # its native lane too
                for p, a in zip(self.procs, self.addresses, strict=False):
                    while not os.path.exists(a[5:] + ".lane"):  # the first start builds it (~20 s)
                        if p.poll() is not None or time.monotonic() > end:
                            raise RuntimeError(f"kvservice on {a} did not open its native lane (--no-lane?)")
                        time.sleep(0.05)
            settle = float(os.environ.get("BENCH_SETTLE_S", "0"))
            if settle > 0:  # let the services' start-up work (JIT warm-up threads) finish first
                time.sleep(settle)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _auth_flags(self, i: int, token: Path) -> list[str]:
        """Service ``i``'s peer-auth flags under ``peer_auth`` (files in the temp dir)."""
        if self.peer_auth == "insecure":
            return ["--insecure"]
        if self.peer_auth == "token":
            if not token.exists():
                token.write_text(os.urandom(16).hex() + "\n")
            return ["--peer-token-file", str(token)]
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from tests.support.pki import CA  # (cryptography: pip install it where it is missing)

        if getattr(self, "_ca", None) is None:
            self._ca = CA(self._tmp.name, "bench-cluster")  # type: ignore[union-attr]
        leaf = self._ca.leaf(f"bench-svc{i}")
        return ["--peer-tls-cert", leaf.cert, "--peer-tls-key", leaf.key, "--peer-tls-ca", self._ca.cert]

    def idle_cpu(self, seconds: float) -> list[float]:
        """Share of one core each service used over ``seconds`` while nobody called it."""
        tick = os.sysconf("SC_CLK_TCK")

        def used() -> list[int]:
            out = []
            for p in self.procs:
                with open(f"/proc/{p.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out.append(int(fields[11]) + int(fields[12]))  # utime + stime
            return out

        before, t0 = used(), time.monotonic()
        time.sleep(seconds)
        after, dt = used(), time.monotonic() - t0
        return [(b - a) / tick / dt for a, b in zip(before, after, strict=True)]

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None and os.environ.get("BENCH_PYSPY_DIR"):
                os.killpg(p.pid, signal.SIGINT)  # py-spy and the service both stop; py-spy writes
            elif p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class KVPool:
    """An engine's KV pool: POSIX shm (``device='cpu'``) or one CUDA allocation (``device=int``).

    Regions are uint8 ``[num_pages, page_bytes]`` views: ``k(l)``, ``v(l)`` (none with K and V in
    one region a layer, e.g. ``nhc``); ``regions()`` gives what ``Client.register_buffers`` takes.
    """

    def __init__(self, layout: Layout, device: str | int = "cpu", fill_seed: int | None = None) -> None:
        self.layout, self.device = layout, device
        L, n, nv = layout.num_layers, layout.num_pages, layout.num_v_regions
        pb = layout.region_bytes_k // n  # a K region's page (with K and V in one region: both)
        if device == "cpu":
            self.shm: ShmKVPool | None = ShmKVPool.create(layout)
            self._k = [self.shm.k(i) for i in range(L)]
            self._v = [self.shm.v(i) for i in range(nv)]
            if fill_seed is not None:
                rng = np.random.default_rng(fill_seed)
                for t in self._k + self._v:
                    t[:] = rng.integers(0, 256, t.shape, dtype=np.uint8)
        else:
            import torch

            self.shm = None
            self.block = torch.zeros((L + nv, n, pb), dtype=torch.uint8, device=f"cuda:{device}")
            if fill_seed is not None:
                g = torch.Generator(device=f"cuda:{device}").manual_seed(fill_seed)
                for r in range(L + nv):
                    self.block[r].copy_(
                        torch.randint(
                            0, 256, (n, pb), generator=g, device=f"cuda:{device}", dtype=torch.uint8
                        )
                    )
                torch.cuda.synchronize(device)
            self._k = [self.block[i] for i in range(L)]
            self._v = [self.block[L + i] for i in range(nv)]

    def k(self, layer: int) -> Any:
        return self._k[layer]

    def v(self, layer: int) -> Any:
        return self._v[layer]

    def regions(self) -> tuple[list[Any], list[Any]]:
        if self.shm is not None:
            return self.shm.k_regions, self.shm.v_regions
        import torch
        from kvservice_client import cuda_region

        # NOTE: cuda_region needs the tensor's device current (see bench findings): on GPU 1 from a
        # process whose current device is 0, cuMemGetAddressRange fails with CUDA_ERROR_NOT_FOUND.
        with torch.cuda.device(int(self.device)):
            return [cuda_region(t) for t in self._k], [cuda_region(t) for t in self._v]

    def page_digest(self, pages: Sequence[int], layers: Sequence[int] | None = None) -> list[int]:
        """Per region (K then V of the given layers) the sum of the named pages' bytes."""
        layers = range(self.layout.num_layers) if layers is None else layers
        out = []
        for t in [self._k[i] for i in layers] + [self._v[i] for i in layers if i < len(self._v)]:
            if self.shm is not None:
                out.append(int(t[list(pages)].astype(np.int64).sum()))
            else:
                import torch

                idx = torch.as_tensor(list(pages), device=t.device)
                out.append(int(t.index_select(0, idx).to(torch.int64).sum().item()))
        return out

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        else:
            self._k, self._v = [], []
            del self.block


@contextlib.contextmanager
def pools(*specs: tuple[Layout, str | int, int | None]) -> Iterator[list[KVPool]]:
    """Create several pools; close them all on exit."""
    made: list[KVPool] = []
    try:
        for layout, dev, seed in specs:
            made.append(KVPool(layout, dev, seed))
        yield made
    finally:
        for p in made:
            p.close()


def base_args(ap: Any, netns: bool = False) -> None:
    """Flags every benchmark takes (``--netns`` only where the benchmark supports it)."""
    ap.add_argument("--device", default="cpu", help="'cpu' (shm pools) or 'cuda'")
    ap.add_argument("--src-gpu", type=int, default=0, help="GPU of the sender engines")
    ap.add_argument("--dst-gpu", type=int, default=0, help="GPU of the receiver engines")
    ap.add_argument("--small", action="store_true", help="tiny sizes for CI (CPU, seconds)")
    ap.add_argument("--out", default="/tmp/kvservice-bench")
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument(
        "--cross-node",
        action="store_true",
        help="two services on this host talk as if on two hosts (same_host_route=off): the transport "
        "carries the pages instead of the same-host fused copy",
    )
    ap.add_argument(
        "--no-lane",
        action="store_true",
        help="services without their native lane (kvservice.transfer.lane): same-node transfers over gRPC, "
        "the baseline the lane is measured against",
    )
    if not netns:
        return
    ap.add_argument(
        "--netns",
        action="store_true",
        help="like --cross-node, and the two services (and the raw NIXL baselines) sit in two network "
        "namespaces joined by a veth pair, UCX over TCP only (needs root)",
    )


@contextlib.contextmanager
def network(args: Any) -> Iterator[Any]:
    """The veth pair of ``--netns`` (None without it); sets ``args.cross_node``."""
    if not getattr(args, "netns", False):
        yield None
        return
    from _netns import veth_pair

    args.cross_node = True
    with veth_pair() as net:
        yield net


def route_env(args: Any) -> dict[str, str]:
    """Service settings for the route the run asks for (see --cross-node)."""
    env = {"KVSERVICE_SAME_HOST_ROUTE": "off"} if getattr(args, "cross_node", False) else {}
    if getattr(args, "no_lane", False):
        env["KVSERVICE_LANE"] = "0"
    return env


def devices(args: Any) -> tuple[str | int, str | int]:
    if args.device == "cpu":
        return "cpu", "cpu"
    return args.src_gpu, args.dst_gpu


def run_tag(args: Any) -> str:
    if args.device == "cpu":
        base = "cpu"
    else:
        base = "gpu" if args.src_gpu == args.dst_gpu else f"gpu{args.src_gpu}to{args.dst_gpu}"
    if getattr(args, "netns", False):
        base += "_netns"
    elif getattr(args, "cross_node", False):
        base += "_xnode"
    if getattr(args, "no_lane", False):
        base += "_nolane"
    return base + ("_small" if args.small else "") + (f"_{args.tag}" if args.tag else "")


def lane_stats(logs: Path) -> dict[str, str]:
    """Each service's closing "cross-node lane: ..." line (kvservice/transfer/lane/cross.py log_stats:
    where its cross-node lane's sends and receives spent their time, µs each)."""
    got = {}
    for f in sorted(logs.glob("svc*.log")):
        for line in f.read_text().splitlines():
            if '"cross-node lane: ' in line:
                got[f.stem] = json.loads(line).get("msg", "")
    return got
