"""Turn bench/results/*.json of the end-to-end benchmarks into PNG plots and SUMMARY.md.

    .venv/bin/python bench/report.py [--results bench/results]

Needs matplotlib for the plots (SUMMARY.md is written without it).
"""

# ruff: noqa: E501  (markdown table rows read better on one line)
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

GOALS = """Goals (reported, not asserted): one GPU >= 100x per-page and >= 30% of ceiling; two GPUs
>= 85% of ceiling and >= 40x per-page; mixed TP >= 100x per-token; CPU auto never slower than the
better of direct and packed; bytes on the wire <= 1.02x unsent bytes; control-plane overhead
<= 1 ms p50 per transfer; MatchPrefix (131,072 tokens) <= 5 ms p50."""


def _load(d: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for f in sorted(d.glob("*.json")):
        try:
            j = json.loads(f.read_text())
        except ValueError:
            continue
        if isinstance(j, dict) and j.get("benchmark") in (
            "transfer",
            "mixed_tp",
            "multiturn",
            "control",
            "routing",
            "launch",
            "convert",
            "ab",
        ):
            out[f.stem] = j
    return out


def _f(x: Any, nd: int = 2) -> str:
    return f"{x:,.{nd}f}" if isinstance(x, (int, float)) else str(x)


def _where(j: dict) -> str:
    m = j["meta"]
    if j["device"] == "cpu":
        return f"CPU, shm pools, host {m['host']} ({m['cpus']} CPUs)"
    return f"{m['gpu']}, GPU {j['src_gpu']}→{j['dst_gpu']}"


def _borrow_baselines(name: str, j: dict, runs: dict[str, dict]) -> None:
    """A run made with --skip-baseline takes the baselines of a run of the same shape and devices."""
    if j["baselines"]:
        return
    for other, o in runs.items():
        same = all(o.get(k) == j.get(k) for k in ("device", "src_gpu", "dst_gpu", "bytes", "pages"))
        if other != name and o["benchmark"] == "transfer" and same and o["baselines"]:
            j["baselines"] = {k: dict(v, borrowed_from=other) for k, v in o["baselines"].items()}
            b = j["baselines"]
            for p, v in j["kvservice"].items():
                if "p50_ms" in v:
                    j["ratios"][p] = {
                        name: b[ref]["p50_ms"] / v["p50_ms"]
                        for name, ref in (
                            ("speedup_vs_per_page", "raw_nixl_per_page"),
                            ("fraction_of_ceiling", "raw_nixl_one_descriptor"),
                            ("fraction_of_contiguous_copy", "contiguous_copy"),
                        )
                        if ref in b
                    }
            return


def _transfer(name: str, j: dict) -> list[str]:
    b, kv, r = j["baselines"], j["kvservice"], j["ratios"]
    lines = [
        f"### {name} — {_where(j)}",
        "",
        f"{j['pages']:,} scattered pages x {2 * j['layout']['layers']} regions x "
        f"{j['layout']['page_bytes_per_region'] // 1024} KiB = {j['bytes'] / 2**30:.2f} GiB, "
        f"{j['iters']} timed rounds",
        "",
        "| method | descriptors | p50 ms | p99 ms | GB/s | vs per-page | of NIXL 1-desc | of contiguous copy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if j.get("same_node"):
        lines.insert(
            1, "(both engines on one service: AUTO takes the fused route, packed is the staged route)"
        )
    copy_ms = b.get("contiguous_copy", {}).get("p50_ms")
    for k, v in b.items():
        frac = f"{_f(100 * copy_ms / v['p50_ms'], 1)}%" if copy_ms else ""
        descs = f"{v['descriptors']:,}" if "descriptors" in v else ""
        lines.append(
            f"| {k} | {descs} | {_f(v['p50_ms'])} | {_f(v['p99_ms'])} | {_f(v.get('gb_per_s', ''))} | | | {frac} |"
        )
    for p, v in kv.items():
        if "p50_ms" not in v:
            lines.append(f"| kvservice path={p} | | FAILED: {v.get('error', '')[:80]} | | | | |")
            continue
        rr = r.get(p, {})
        lines.append(
            f"| kvservice path={p} ({v['path_taken']}) | {v['descriptors']:,} | {_f(v['p50_ms'])} | {_f(v['p99_ms'])} "
            f"| {_f(v['gb_per_s'])} | {_f(rr.get('speedup_vs_per_page', ''), 1)}x "
            f"| {_f(100 * rr.get('fraction_of_ceiling', 0), 1)}% "
            f"| {_f(100 * rr.get('fraction_of_contiguous_copy', 0), 1)}% |"
        )
    lines += ["", "kvservice phases (sender, median us; recv_* on the receiver):", ""]
    for p, v in kv.items():
        if "phases_us_median" in v:
            ph = ", ".join(f"{k} {int(x):,}" for k, x in v["phases_us_median"].items())
            lines.append(f"- {p}: {ph}; verified={v.get('verified')}")
    if "auto_vs_best_of_direct_packed" in r:
        lines.append(f"- auto / best(direct, packed) = {r['auto_vs_best_of_direct_packed']:.2f}")
    return lines + [""]


def _mixed(name: str, j: dict) -> list[str]:
    copy = j.get("baselines", {}).get("contiguous_copy", {}).get("p50_ms")
    lines = [
        f"### {name} — {_where(j)}",
        "",
        f"{j['pages']} pages x {j['layout']['layers']} layers ({j['bytes'] / 2**20:.0f} MiB of KV in all), median of {j['iters']}"
        + (f"; contiguous copy of those bytes {_f(copy, 3)} ms" if copy else ""),
        "",
        "| TP | per-token descs | per-token p50 ms | kvservice p50 ms | kvservice p99 ms | kvservice GB/s | speedup | of a copy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, e in j["configs"].items():
        b, kv = e.get("raw_nixl_per_token", {}), e["kvservice"]
        base = f"{b['descriptors']:,} | {_f(b['p50_ms'])}" if b else "(not run) | "
        if "p50_ms" in kv:
            speedup = f"{_f(e['speedup_vs_per_token'], 1)}x" if "speedup_vs_per_token" in e else ""
            share = f"{e['fraction_of_contiguous_copy']:.0%}" if "fraction_of_contiguous_copy" in e else ""
            lines.append(
                f"| {k} | {base} | {_f(kv['p50_ms'])} | {_f(kv['p99_ms'])} "
                f"| {_f(kv['gb_per_s'])} | {speedup} | {share} |"
            )
        else:
            lines.append(f"| {k} | {base} | FAILED: {kv.get('error', '')[:80]} | | | | |")
    return lines + [""]


def _multi(name: str, j: dict) -> list[str]:
    w = j["workload"]
    lines = [
        f"### {name} — {_where(j)}",
        "",
        f"{w['sessions']} prefixes x ~{w['prefix_tokens']:,} tokens + ~{w['suffix_tokens']:,}-token suffixes, "
        f"{w['requests']} requests, concurrency {w['concurrency']}, {w['layers']} layers",
        "",
        "| mode | ok/total | reuse | GiB sent | wire/needed | p50 ms | p99 ms | warm p50 | warm p99 | warm req/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, e in j["modes"].items():
        la, lw = e["latency"], e["latency_warm"]
        lines.append(
            f"| {m} | {e['ok']}/{e['requests']} | {100 * e['reuse']:.1f}% | {e['bytes_sent_total'] / 2**30:.2f} "
            f"| {_f(e['wire_bytes_over_needed'], 3)} | {_f(la.get('p50_ms'))} | {_f(la.get('p99_ms'))} "
            f"| {_f(lw.get('p50_ms'))} | {_f(lw.get('p99_ms'))} | {_f(e['warm_requests_per_s'], 1)} |"
        )
    if j.get("ratios"):
        lines.append("")
        lines.append("- " + ", ".join(f"{k} {v:.2f}" for k, v in j["ratios"].items()))
    return lines + [""]


def _control(name: str, j: dict) -> list[str]:
    lines = [
        f"### {name} — CPU, shm pools, host {j['meta']['host']} ({j['meta']['cpus']} CPUs, {j['meta']['gpu']})",
        "",
        "| call | p50 ms | p99 ms |",
        "|---|---|---|",
    ]
    for k, v in j["rpc"].items():
        lines.append(f"| {k} | {_f(v['p50_ms'], 3)} | {_f(v['p99_ms'], 3)} |")
    raw = j["raw_nixl_one_page"]
    lines.append(f"| raw NIXL one-page write | {_f(raw['p50_ms'], 3)} | {_f(raw['p99_ms'], 3)} |")
    rows = j.get("sustained_by_senders") or [j["sustained"]]
    rates = ", ".join(f"{_f(r['transfers_per_s'], 0)} with {r['threads']}" for r in rows)
    lines += [
        "",
        f"MatchPrefix prompt {j['prompt_tokens']:,} tokens ({j['matched_pages']:,} pages matched); "
        f"overhead per transfer (e2e p50 - raw p50) {_f(j['overhead_per_transfer_p50_ms'], 3)} ms; "
        f"sustained one-page transfers/s by concurrent senders: {rates}.",
        "",
    ]
    if "idle_cpu_fraction_of_core" in j:
        idle = ", ".join(f"{c:.1%}" for c in j["idle_cpu_fraction_of_core"])
        lines += [
            f"Idle CPU afterwards, per service process: {idle} of a core "
            f"(NIXL progress delay: {j.get('nixl_progress_delay_us', 'default')} us).",
            "",
        ]
    return lines


def _routing(name: str, j: dict) -> list[str]:
    m = j["model"]
    lines = [
        f"### {name} — CPU, shm pools, host {j['meta']['host']} ({j['meta']['cpus']} CPUs)",
        "",
        f"Engines simulated: prefill {m['prefill_us_per_token']} us/token (one at a time), decode "
        f"{m['decode_ms_per_token']} ms/token ({m['decode_slots']} at once), pools P {m['prefill_pages']} / "
        f"D {m['decode_pages']} pages of {m['page_size']} tokens, request timeout {m['request_timeout_s']} s, "
        f"think times x{m['time_scale']}, budget {m['budget']} inbound transfers per D (admission policies).",
        "",
        "| trace | xPyD | policy | ok/total | errors | e2e p50 / p90 / p99 s | TTFT p50 / p99 s | cached tok "
        "| P cached tok | prefill new tok | MiB moved | D queue mean / p90 | direct | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in j["runs"]:
        e, t, q = r["e2e"], r["ttft"], r["decode_transfer_queue"]
        errs = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "-"
        lines.append(
            f"| {r['shape']} | {r['config']} | {r['policy']} | {r['ok']}/{r['total']} | {errs} "
            f"| {_f(e.get('p50_ms', 0) / 1e3)} / {_f(e.get('p90_ms', 0) / 1e3)} / {_f(e.get('p99_ms', 0) / 1e3)} "
            f"| {_f(t.get('p50_ms', 0) / 1e3)} / {_f(t.get('p99_ms', 0) / 1e3)} | {r['cached_tokens']:,} "
            f"| {r['prefill_cached_tokens']:,} | {r['prefill_new_tokens']:,} | {r['bytes_moved'] / 2**20:,.0f} "
            f"| {_f(q['mean'])} / {_f(q['p90'], 0)} | {r['routes'].get('direct', 0)} | {r['fallbacks']} |"
        )
    ev = j.get("eviction_sequential") or []
    if ev:
        lines += [
            "",
            "Eviction alone (the same requests one at a time, no compute time, 2P2D, admission routing): "
            "prefill-side LRU vs duplicate-aware eviction.",
            "",
            "| trace | P eviction | ok/total | P cached tok | prefill new tok | P pages evicted | direct | errors |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in ev:
            errs = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "-"
            kind = "duplicate-aware" if r["policy"] == "admission+dup" else "LRU"
            lines.append(
                f"| {r['shape']} | {kind} | {r['ok']}/{r['total']} | {r['prefill_cached_tokens']:,} "
                f"| {r['prefill_new_tokens']:,} | {r['prefill_evicted_pages']:,} | {r['routes'].get('direct', 0)} "
                f"| {errs} |"
            )
    rc = j.get("router_calls")
    if rc:
        lines += [
            "",
            f"Router calls (one service, idle): MatchPrefix 131,072 tokens scores_only with load p50 "
            f"{_f(rc['match_prefix_128k_scores']['p50_ms'], 3)} ms (p99 {_f(rc['match_prefix_128k_scores']['p99_ms'], 3)}); "
            f"over-budget ExpectDelta refused p50 {_f(rc['expect_delta_refused']['p50_ms'], 3)} ms "
            f"(p99 {_f(rc['expect_delta_refused']['p99_ms'], 3)}; without the SDK, raw stub: "
            f"{_f(rc.get('expect_delta_refused_raw_stub', {}).get('p50_ms'), 3)} ms); baseline health "
            f"check p50 {_f(rc['health']['p50_ms'], 3)} ms.",
        ]
    return lines + [""]


def _goals(runs: dict[str, dict]) -> list[str]:
    rows = []

    def add(goal: str, run: str, value: str, ok: bool) -> None:
        rows.append(f"| {goal} | {run} | {value} | {'met' if ok else '**missed**'} |")

    for name, j in runs.items():
        same = j["benchmark"] == "transfer" and (j.get("same_node") or "samehost" in name)
        frac = j["ratios"].get("auto", {}).get("fraction_of_contiguous_copy") if same else None
        if frac is not None and j["bytes"] >= 64 << 20:
            if j["device"] == "cpu":
                goal = 0.70
            else:
                goal = 0.85 if j["src_gpu"] == j["dst_gpu"] else 0.90
            add(f"same node >= {goal:.0%} of a contiguous copy", name, f"{frac:.1%}", frac >= goal)
        if same:
            continue
        if (
            j["benchmark"] == "transfer"
            and j["device"] != "cpu"
            and "fraction_of_ceiling" in j["ratios"].get("auto", {})
        ):
            r = j["ratios"]["auto"]
            one = j["src_gpu"] == j["dst_gpu"]
            sp, ce = (100, 0.30) if one else (40, 0.85)
            add(
                f">= {sp}x per-page", name, f"{r['speedup_vs_per_page']:.1f}x", r["speedup_vs_per_page"] >= sp
            )
            add(
                f">= {ce:.0%} of ceiling",
                name,
                f"{r['fraction_of_ceiling']:.1%}",
                r["fraction_of_ceiling"] >= ce,
            )
        if (
            j["benchmark"] == "transfer"
            and j.get("netns")
            and "fraction_of_ceiling" in j["ratios"].get("auto", {})
        ):
            # issue 13's CPU goals: two namespaces over a veth pair, UCX on TCP
            r = j["ratios"]["auto"]
            add(">= 85% of one descriptor (netns, TCP)", name, f"{r['fraction_of_ceiling']:.1%}",
                r["fraction_of_ceiling"] >= 0.85)  # fmt: skip
            add(">= 10x per-page (netns, TCP)", name, f"{r['speedup_vs_per_page']:.1f}x",
                r["speedup_vs_per_page"] >= 10)  # fmt: skip
        if j["benchmark"] == "transfer" and "auto_vs_best_of_direct_packed" in j["ratios"]:
            x = j["ratios"]["auto_vs_best_of_direct_packed"]
            add("CPU auto <= best(direct, packed)", name, f"{x:.2f}x of best", x <= 1.0)
        sps = [
            e.get("speedup_vs_per_token", 0)
            for e in j.get("configs", {}).values()
            if "raw_nixl_per_token" in e
        ]
        if j["benchmark"] == "mixed_tp" and j.get("netns") and sps:
            add(">= 10x per-token, mixed TP (netns, TCP)", name, f"min {min(sps):.1f}x", min(sps) >= 10)
        if j["benchmark"] == "mixed_tp" and j["device"] != "cpu" and sps:
            add(">= 100x per-token (mixed TP)", name, f"min {min(sps):.0f}x", min(sps) >= 100)
        if j["benchmark"] == "multiturn":
            x = max(e["wire_bytes_over_needed"] for e in j["modes"].values())
            add("wire bytes <= 1.02x unsent", name, f"{x:.3f}x", x <= 1.02)
        if j["benchmark"] == "routing":
            _routing_goals(name, j, add)
        if j["benchmark"] == "control":
            o = j["overhead_per_transfer_p50_ms"]
            add("control overhead <= 1 ms p50", name, f"{o:.2f} ms", o <= 1.0)
            m = j["rpc"]["match_prefix"]["p50_ms"]
            add("MatchPrefix 131K tokens <= 5 ms p50", name, f"{m:.2f} ms", m <= 5.0)
    return ["## Goals", "", "| goal | run | value | status |", "|---|---|---|---|", *rows, ""]


def _routing_goals(name: str, j: dict, add: Any) -> None:
    by = {(r["shape"], r["config"], r["policy"]): r for r in j["runs"]}
    for (shape, cfg, pol), r in by.items():
        if pol != "admission":
            continue
        base = by.get((shape, cfg, "prefix"))
        if base is None:
            continue
        where = f"{name} {shape} {cfg}"
        if base["ok"] < base["total"] or base["decode_transfer_queue"]["p90"] >= 4:  # prefix saturates
            full = r["ok"] == r["total"]
            add(
                "admission: 100% ok/total where prefix-aware saturates",
                where,
                f"{r['ok']}/{r['total']}",
                full,
            )
            a99, b99 = r["e2e"].get("p99_ms", 0), base["e2e"].get("p99_ms", 0)
            add(
                "admission: p99 e2e below prefix-aware",
                where,
                f"{a99 / 1e3:.2f} s vs {b99 / 1e3:.2f} s",
                a99 < b99,
            )
            tmo = sum(v for k, v in r["errors"].items() if k.startswith("transfer_"))
            add("admission: no transfer-timeout failure", where, str(tmo), tmo == 0)
    ev = {(r["shape"], r["policy"]): r for r in j.get("eviction_sequential") or []}
    for (shape, pol), dup in ev.items():
        lru = ev.get((shape, "admission"))
        if pol != "admission+dup" or lru is None:
            continue
        gain = dup["prefill_cached_tokens"] / max(lru["prefill_cached_tokens"], 1) - 1
        add("dup-aware eviction raises P cached tokens over LRU (sequential)", f"{name} {shape}", f"{gain:+.1%}",
            gain > 0)  # fmt: skip
    bad = sum(r["errors"].get("kv_mismatch", 0) for r in [*j["runs"], *ev.values()])
    verified = sum(r["pages_verified"] for r in [*j["runs"], *ev.values()])
    if verified:  # a --latency-only run replays nothing
        add(
            "no transfer sourced from an evicted page",
            name,
            f"{bad} mismatches in {verified:,} pages checked",
            bad == 0,
        )
    rc = j.get("router_calls")
    if rc:
        mp, ed = rc["match_prefix_128k_scores"]["p50_ms"], rc["expect_delta_refused"]["p50_ms"]
        add("MatchPrefix with load 128K tokens <= 5 ms p50", name, f"{mp:.2f} ms", mp <= 5.0)
        add("over-budget ExpectDelta refused <= 1 ms p50", name, f"{ed:.2f} ms", ed <= 1.0)


def _plots(d: Path, runs: dict[str, dict]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for name, j in runs.items():
        if j["benchmark"] == "convert":  # a table in SUMMARY.md, no plot
            continue
        fig, ax = plt.subplots(figsize=(7, 3.2))
        if j["benchmark"] == "transfer":
            labels = list(j["baselines"]) + [
                f"kvservice {p}" for p, v in j["kvservice"].items() if "p50_ms" in v
            ]
            vals = [v["p50_ms"] for v in j["baselines"].values()] + [
                v["p50_ms"] for v in j["kvservice"].values() if "p50_ms" in v
            ]
            ax.barh(
                labels,
                vals,
                color=["#999"] * len(j["baselines"]) + ["#2a7"] * (len(vals) - len(j["baselines"])),
            )
            ax.set_xscale("log")
            ax.set_xlabel("ms (p50, log)")
            made += _timeline_plots(plt, d, name, j)
        elif j["benchmark"] == "mixed_tp":
            ks = list(j["configs"])
            per_token = all("raw_nixl_per_token" in j["configs"][k] for k in ks)  # --skip-per-token: a copy
            base = [
                j["configs"][k]["raw_nixl_per_token"]["p50_ms"]
                if per_token
                else j["baselines"]["contiguous_copy"]["p50_ms"]
                for k in ks
            ]
            kv = [j["configs"][k]["kvservice"].get("p50_ms", 0) for k in ks]
            x = range(len(ks))
            ax.bar(
                [i - 0.2 for i in x],
                base,
                0.4,
                label="raw NIXL per-token" if per_token else "copy of the same bytes",
                color="#999",
            )
            ax.bar([i + 0.2 for i in x], kv, 0.4, label="kvservice", color="#2a7")
            ax.set_xticks(list(x), ks)
            ax.set_yscale("log")
            ax.set_ylabel("ms (p50, log)")
            ax.legend()
        elif j["benchmark"] == "routing":
            plt.close(fig)
            made += _routing_plot(plt, d, name, j)
            continue
        elif j["benchmark"] == "launch":  # a table row in SUMMARY.md, no plot
            plt.close(fig)
            continue
        elif j["benchmark"] == "multiturn":
            for m, e in j["modes"].items():
                lat = sorted(r["latency_ms"] for r in e["rows"] if r.get("ok"))
                ax.plot(
                    lat,
                    [(i + 1) / len(lat) for i in range(len(lat))],
                    label=f"{m} ({e['bytes_sent_total'] / 2**30:.1f} GiB)",
                )
            ax.set_xscale("log")
            ax.set_xlabel("request latency ms (MatchPrefix → DONE)")
            ax.set_ylabel("CDF")
            ax.legend()
        else:
            ks = list(j["rpc"])
            ax.bar(ks, [j["rpc"][k]["p50_ms"] for k in ks], label="p50", color="#2a7")
            ax.bar(
                ks,
                [j["rpc"][k]["p99_ms"] - j["rpc"][k]["p50_ms"] for k in ks],
                bottom=[j["rpc"][k]["p50_ms"] for k in ks],
                label="p99",
                color="#ccc",
            )
            ax.set_ylabel("ms")
            ax.legend()
        ax.set_title(f"{name} ({j['meta']['gpu']})", fontsize=9)
        fig.tight_layout()
        fig.savefig(d / f"{name}.png", dpi=110)
        plt.close(fig)
        made.append(f"{name}.png")
    return made


def _timeline_plots(plt: Any, d: Path, name: str, j: dict) -> list[str]:
    """``bench_transfer --timeline``: one row per packed batch of the last round, bars for the wait
    for a staging slot or credit, pack, write and the receiver's unpack (ms since the chunk)."""
    made = []
    for path, v in j["kvservice"].items():
        rows = v.get("timeline") or []
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, max(2.4, 1.2 + 0.3 * len(rows))))
        for i, r in enumerate(rows):
            spans = [("wait", r["start"], r["slot"], "#ddd"), ("pack", r["slot"], r["packed"], "#2a7"),
                     ("write", r["packed"], r["written"], "#37c")]  # fmt: skip
            if r.get("unpack_start") is not None:
                spans.append(("unpack", r["unpack_start"], r["unpack_end"], "#e83"))
            for label, a, b, color in spans:
                ax.broken_barh(
                    [(a, max(b - a, 0.01))], (i - 0.4, 0.8), color=color, label=label if i == 0 else None
                )
        ax.set_yticks(
            range(len(rows)), [f"batch {i}: {r['bytes'] >> 20} MiB" for i, r in enumerate(rows)], fontsize=7
        )
        ax.invert_yaxis()
        ax.set_xlabel("ms since the chunk was queued")
        ax.set_title(f"{name}: {path}, packed batches (p50 {v['p50_ms']:.1f} ms)", fontsize=9)
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.5))
        fig.tight_layout()
        fig.savefig(d / f"{name}_{path}_timeline.png", dpi=110)
        plt.close(fig)
        made.append(f"{name}_{path}_timeline.png")
    return made


def _routing_plot(plt: Any, d: Path, name: str, j: dict) -> list[str]:
    groups = sorted({(r["shape"], r["config"]) for r in j["runs"]})
    if not groups:
        ev = j.get("eviction_sequential") or []
        if not ev:
            return []
        fig, ax = plt.subplots(figsize=(5, 3.2))
        shapes = sorted({r["shape"] for r in ev})
        for k, (pol, label, color) in enumerate(
            (("admission", "LRU", "#999"), ("admission+dup", "duplicate-aware", "#2a7"))
        ):
            vals = [next((r["prefill_cached_tokens"] for r in ev if (r["shape"], r["policy"]) == (sh, pol)), 0)
                    for sh in shapes]  # fmt: skip
            ax.bar([i + (k - 0.5) * 0.4 for i in range(len(shapes))], vals, 0.4, label=label, color=color)
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_ylabel("prefill cached tokens")
        ax.set_title(f"{name}: P eviction, same requests one at a time", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(d / f"{name}.png", dpi=110)
        plt.close(fig)
        return [f"{name}.png"]
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.4), squeeze=False)
    for ax, (shape, cfg) in zip(axes[0], groups, strict=True):
        rs = [r for r in j["runs"] if (r["shape"], r["config"]) == (shape, cfg)]
        x = range(len(rs))
        ax.bar(
            [i - 0.2 for i in x],
            [r["e2e"].get("p50_ms", 0) / 1e3 for r in rs],
            0.4,
            label="e2e p50",
            color="#2a7",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [r["e2e"].get("p99_ms", 0) / 1e3 for r in rs],
            0.4,
            label="e2e p99",
            color="#999",
        )
        for i, r in enumerate(rs):
            ax.annotate(
                f"{r['ok']}/{r['total']}", (i, r["e2e"].get("p99_ms", 0) / 1e3), ha="center", fontsize=7
            )
        ax.set_xticks(list(x), [r["policy"] for r in rs], rotation=20, fontsize=7)
        ax.set_ylabel("s")
        ax.set_title(f"{shape} {cfg}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(d / f"{name}.png", dpi=110)
    plt.close(fig)
    return [f"{name}.png"]


def _convert(name: str, j: dict[str, Any]) -> list[str]:
    """Each conversion against the same-layout copy of the same bytes, same run."""
    out = [
        f"`{name}` ({j['meta'].get('gpu') if j['meta'].get('gpu') not in (None, '', 'none') else 'CPU'}; {j['tokens']} tokens x {j['layers']} layers x "
        f"{j['heads']} heads x {j['head_dim']}, {j['dtype']}; contiguous copy {j['memcpy_gbps']} GB/s; "
        f"`{j['command']}`)",
        "",
        "| case | unit (tokens) | fused GB/s | vs same layout | pack+unpack GB/s | vs same layout |",
        "|---|---|---|---|---|---|",
    ]
    for c in j["cases"]:
        out.append(
            f"| {c['case']} | {c['unit_tokens']} | {c['fused_gbps']} | {c['fused_vs_same_layout']}x | "
            f"{c['pack_unpack_gbps']} | {c['pack_unpack_vs_same_layout']}x |"
        )
    return [*out, ""]


def _p50(j: dict, path: str = "auto") -> float | None:
    v = j.get("kvservice", {}).get(path, {})
    return v.get("p50_ms") if isinstance(v, dict) else None


def _base(j: dict, name: str) -> float | None:
    v = j.get("baselines", {}).get(name, {})
    return v.get("p50_ms") if isinstance(v, dict) else None


def _sustained(j: dict) -> tuple[int, str, float]:
    """A bench_control run's most senders: their count, "N/s one process; M/s in K engine pairs",
    and the better of the two rates."""
    top = max(j["sustained_by_senders"], key=lambda r: r["threads"])
    pairs = [r for r in j.get("sustained_by_engine_pairs", []) if r["senders"] == top["threads"]]
    best = max([top["transfers_per_s"], *(r["transfers_per_s"] for r in pairs)])
    value = f"{top['transfers_per_s']:.0f}/s one process" + (
        f"; {pairs[0]['transfers_per_s']:.0f}/s in {pairs[0]['engine_pairs']} engine pairs" if pairs else ""
    )
    return top["threads"], value, best


def _headline(runs: dict[str, dict]) -> list[str]:
    """The GPU path's goals (issue 28, data path v3): the latest figure beside its same-run
    baseline, one row per goal; runs missing from this folder are left out."""
    rows: list[str] = []  # one per goal: met or missed
    compare: list[str] = []  # same-run comparisons (A/B, lane vs gRPC, floors): no goal of their own

    def latest(*names: str) -> str:
        """Of several runs of one goal, the one measured last."""
        have = [n for n in names if n in runs]
        return max(have, key=lambda n: runs[n].get("meta", {}).get("unix_time", 0)) if have else names[0]

    def row(goal: str, run: str, value: str, base: str, met: bool | None) -> None:
        status = "" if met is None else ("met" if met else "**missed**")
        gpu = str(runs.get(run, {}).get("meta", {}).get("gpu", ""))
        card = next((c for c in ("H200", "H100") if c in gpu), "")  # H100 and H200 rows mix here
        if not card and runs.get(run, {}).get("meta", {}).get("host") == "vm":
            card = f"{runs[run]['meta'].get('cpus', '?')}-core VM, CPU"
        (rows if met is not None else compare).append(
            f"| {goal} | {run}{f' ({card})' if card else ''} | {value} | {base} | {status} |"
        )

    def share_row(goal: str, run: str, baseline: str, label: str, at_least: float | None) -> None:
        """A row for "``run`` reaches ``at_least`` of the same-run ``baseline``'s rate" (None: a
        comparison, no goal of its own)."""
        j = runs.get(run)
        if j and _p50(j) and _base(j, baseline):
            frac = _base(j, baseline) / _p50(j)
            env = j.get("meta", {}).get("service_env") or {}  # a run with non-default settings says so
            knobs = "".join(f"; {k}={v}" for k, v in sorted(env.items()))
            row(
                goal,
                run,
                f"{_p50(j):.2f} ms ({frac:.1%}{knobs})",
                f"{label} {_base(j, baseline):.2f} ms",
                None if at_least is None else frac >= at_least,
            )

    def median_row(
        goal: str, names: tuple[str, ...], baseline: str, label: str, at_least: float | None
    ) -> None:
        """Several runs of one goal on the same code (each beside its own same-run baseline): the
        status is their median share's; the run shown is the one nearest that median."""
        fr = {n: _base(runs[n], baseline) / _p50(runs[n]) for n in names if n in runs and _p50(runs[n]) and _base(runs[n], baseline)}  # fmt: skip
        if not fr:
            return
        med = statistics.median(fr.values())
        run = min(fr, key=lambda n: abs(fr[n] - med))
        env = runs[run].get("meta", {}).get("service_env") or {}
        mps = (
            "; CUDA MPS"
            if runs[run].get("meta", {}).get("cuda_mps_pipe") or runs[run].get("meta", {}).get("cuda_mps")
            else ""
        )
        knobs = "".join(f"; {k}={v}" for k, v in sorted(env.items())) + mps
        each = " / ".join(f"{v:.1%}" for v in sorted(fr.values()))
        row(goal, run, f"{_p50(runs[run]):.2f} ms (median of {len(fr)} runs {med:.1%}: {each}{knobs})",
            f"{label} {_base(runs[run], baseline):.2f} ms", None if at_least is None else med >= at_least)  # fmt: skip

    def stage_row(run: str) -> None:
        """Issue 28: in the cross-node 2 GiB run's batch timeline (the lane's chunks), each pack and
        unpack >= 70% of the device copy's rate and each WRITE >= 70% of NIXL's one descriptor.
        The WRITE's end is seen only after the sender's next pack: its rate is a lower bound."""
        j = runs.get(run)
        st = (j or {}).get("kvservice", {}).get("auto", {}).get("lane_timeline", {}).get("stages")
        if not j or not st:
            return
        gb = j["bytes"] / 1e9
        copy, nixl = (
            gb / (_base(j, "contiguous_copy") * 1e-3),
            gb / (_base(j, "raw_nixl_one_descriptor") * 1e-3),
        )
        pack, unpack, write = (st[k]["median_gbps"] for k in ("pack", "unpack", "write_seen"))
        value = (f"median chunk: pack {pack:.0f} GB/s ({pack / copy:.0%} of the copy's), unpack {unpack:.0f} GB/s "
                 f"({unpack / copy:.0%}), WRITE >= {write:.0f} GB/s ({write / nixl:.0%} of NIXL's); the three overlap "
                 f"on one HBM: together {(pack + unpack + write) / copy:.0%} of the copy's rate")  # fmt: skip
        met = min(pack, unpack) >= 0.7 * copy and write >= 0.7 * nixl
        row("cross-node 2 GiB on one GPU, batch timeline: pack, unpack >= 70% of a copy, WRITE >= 70% of NIXL",
            run, value, f"copy {copy:.0f} GB/s, NIXL 1 desc {nixl:.0f} GB/s", met)  # fmt: skip

    # at the defaults since 2026-11-29 (second session): the lane's thread spins 5 ms after a
    # message, engines' waiters 5 ms (auto on a GPU lane); five runs over two device calls
    median_row(
        "same node 2 GiB >= 85% of a device copy",
        tuple(f"transfer_same_node_gpu_fin29b{i}" for i in range(1, 6)),
        "contiguous_copy",
        "copy",
        0.85,
    )
    median_row("same node 2 GiB, the kernel at two block sizes with KVSERVICE_LANE_SPIN_US=5000 (before the spins were defaults)",
               tuple(f"transfer_same_node_gpu_{t}" for t in ("shape1", "shape4", "shape5", "shape6")),
               "contiguous_copy", "copy", None)  # fmt: skip
    median_row("same node 2 GiB, lane thread 2 ms and waiters 2 ms (auto, first try)",
               tuple(f"transfer_same_node_gpu_auto{i}" for i in range(1, 4)), "contiguous_copy", "copy", None)  # fmt: skip
    share_row("same node 2 GiB with no spin anywhere (the defaults before 2026-11-29, second session)",
              "transfer_same_node_gpu_shape_nospin2", "contiguous_copy", "copy", None)  # fmt: skip
    share_row("same node 2 GiB before the two block sizes (five runs' median 83.9%: NOTES.md)",
              "transfer_same_node_gpu_fast", "contiguous_copy", "copy", None)  # fmt: skip
    for tag, goal in (("64k", 0.3), ("1m", 0.35), ("64m", None)):
        run = latest(f"transfer_same_node_gpu_delta_{tag}", f"transfer_same_node_gpu_delta_{tag}_shape")
        j = runs.get(run)
        if j and _p50(j):
            copy = _base(j, "contiguous_copy") or 0.0
            limit = goal if goal is not None else 0.3 + 1.2 * copy
            base = f"copy {copy:.3f} ms" if copy else "(no copy baseline in this run)"
            row(f"same node {tag} delta <= {limit:.2f} ms p50", run,
                f"{_p50(j):.2f} ms", base, _p50(j) <= limit)  # fmt: skip
    for tag in ("64k", "64m"):  # the latest of: the gRPC route's runs, the cross-node lane's
        run = latest(f"transfer_gpu_xnode_xdelta_{tag}", f"transfer_gpu_xnode_xlane_{tag}",
                     f"transfer_gpu_xnode_xlane_final_{tag}", f"transfer_gpu_xnode_xlane_x2host_{tag}",
                     f"transfer_gpu_xnode_xlane_open_{tag}")  # fmt: skip
        j = runs.get(run)
        if j and _p50(j) and _base(j, "raw_nixl_one_descriptor"):
            nixl = _base(j, "raw_nixl_one_descriptor")
            limit = 1.0 if tag == "64k" else 2 * nixl + 0.5
            row(f"cross-node {tag} <= {limit:.2f} ms p50", run, f"{_p50(j):.2f} ms", f"NIXL 1 desc {nixl:.2f} ms",
                _p50(j) <= limit)  # fmt: skip
    # both services on one GPU under CUDA MPS (without it their kernels time-slice: the row below),
    # default staging, eight runs over three device calls on the two-block-size kernel (the six
    # before it: NOTES.md); then 2 GiB of staging, two runs (the third, mps_g2, has no NIXL
    # baseline of its own: NOTES.md)
    # since 2026-11-29 (second session) the sender's bulk thread spins after an offer and the
    # engines' waiters 5 ms: six runs over two device calls (mps_fin29b_tl with the DEBUG timeline)
    median_row("cross-node 2 GiB on one GPU >= 30% of NIXL 1 desc",
               tuple(f"transfer_gpu_xnode_mps_fin29b{i}" for i in ("1", "2", "3", "4", "5", "_tl")),
               "raw_nixl_one_descriptor", "NIXL 1 desc", 0.30)  # fmt: skip
    stage_row("transfer_gpu_xnode_mps_fin29b_tl")
    median_row("cross-node 2 GiB on one GPU under MPS, before the bulk thread's spin (eight runs, 2026-11-29 first session)",
               tuple(f"transfer_gpu_xnode_mps_shape{i}" for i in range(1, 9)),
               "raw_nixl_one_descriptor", "NIXL 1 desc", None)  # fmt: skip
    median_row("cross-node 2 GiB on one GPU under MPS, chunks ramped 1/8-1/4-1/2 at both ends (reverted)",
               ("transfer_gpu_xnode_mps_ramp1", "transfer_gpu_xnode_mps_ramp2"), "raw_nixl_one_descriptor", "NIXL 1 desc", None)  # fmt: skip
    median_row("cross-node 2 GiB on one GPU under MPS, flat chunks, same calls as the ramp",
               ("transfer_gpu_xnode_mps_flat1", "transfer_gpu_xnode_mps_flat2"), "raw_nixl_one_descriptor", "NIXL 1 desc", None)  # fmt: skip
    median_row("cross-node 2 GiB on one GPU under MPS, lane_cross_gpu_mb 2048 (>= 30% of NIXL 1 desc)",
               ("transfer_gpu_xnode_mps_ab_g21", "transfer_gpu_xnode_mps_ab_g22"),
               "raw_nixl_one_descriptor", "NIXL 1 desc", 0.30)  # fmt: skip
    share_row("cross-node 2 GiB on one GPU, default staging (1 GiB, 4 parts): the two services' kernels time-slice", "transfer_gpu_xnode_lane_stream_p4",
              "raw_nixl_one_descriptor", "NIXL 1 desc", None)  # fmt: skip
    ctl = latest("control_gpu_xnode", "control_gpu_xnode_xlane", "control_gpu_xnode_xlane2",
                 "control_gpu_xnode_xlane_final", "control_gpu_xnode_xlane_open")  # fmt: skip  # the other calls: NOTES.md
    if ctl:
        j = runs.get(ctl)
        if j and j.get("sustained_by_senders"):
            senders, value, best = _sustained(j)
            row(f"cross-node one-page transfers/s, {senders} senders >= 1,000", ctl, value,
                f"raw NIXL one page {j['raw_nixl_one_page']['p50_ms']:.3f} ms", best >= 1000)  # fmt: skip
    for tag in ("64k", "64m"):  # each service on its own GPU (2×H200): the cross-node lane GPU0 -> GPU1
        j, one = (
            runs.get(f"transfer_gpu0to1_xnode_xlane_{tag}"),
            runs.get(f"transfer_gpu_xnode_xlane_x2host_{tag}"),
        )
        if j and one and _p50(j) and _p50(one) and _base(j, "raw_nixl_one_descriptor"):
            row(f"cross-node {tag}, each service on its own GPU (GPU0 -> GPU1), cross-node lane",
                f"transfer_gpu0to1_xnode_xlane_{tag}",
                f"{_p50(j):.3f} ms (NIXL 1 desc {_base(j, 'raw_nixl_one_descriptor'):.3f} ms)",
                f"both services on GPU0, same call: {_p50(one):.3f} ms", None)  # fmt: skip
    for tag in ("64k", "64m"):  # the cross-node lane against the gRPC route, one device call
        j, nl = (
            runs.get(f"transfer_gpu_xnode_xlane_{tag}"),
            runs.get(f"transfer_gpu_xnode_nolane_xlane_{tag}"),
        )
        if j and nl and _p50(j) and _p50(nl):
            row(f"cross-node {tag}: the cross-node lane vs the gRPC route, same call", f"transfer_gpu_xnode_xlane_{tag}",
                f"{_p50(j):.3f} ms (lane)", f"{_p50(nl):.3f} ms (gRPC route, --no-lane)", None)  # fmt: skip
    ab, ctl = runs.get("ab_plan_offer_transfer_cpu"), runs.get("ab_plan_offer_cpu")
    if ab:  # no GPU figure yet: the step's CPU A/B, both sides in one session on one VM
        med = {k: statistics.median(v["auto"]["p50_ms"]) for k, v in ab["summary"].items()}
        sus = {
            k: statistics.median(v["sustained_per_s"]["8"]) for k, v in (ctl or {}).get("summary", {}).items()
        }
        rate = {k: f"; {v:.0f}/s with 8 senders" for k, v in sus.items()}
        compare.append(
            "| cross-node one page, plan offered at ExpectDelta (CPU A/B, 2-core VM) "
            f"| ab_plan_offer_transfer_cpu | {med['new']:.2f} ms{rate.get('new', '')} "
            f"| plan asked: {med['base']:.2f} ms{rate.get('base', '')} | |"
        )
    j, nl = runs.get("control_same_node_gpu"), runs.get("control_same_node_gpu_nolane")
    if j and j.get("sustained_by_senders"):
        senders, value, best = _sustained(j)
        base = ""
        if nl and nl.get("sustained_by_senders"):
            ntop = max(nl["sustained_by_senders"], key=lambda r: r["threads"])
            base = f"gRPC route (--no-lane) {ntop['transfers_per_s']:.0f}/s"
        row(f"same node one-page transfers/s, {senders} senders >= 2,000", "control_same_node_gpu",
            value, base, best >= 2000)  # fmt: skip
    for ab in ("control_same_node_gpu_ab", "control_same_node_gpu_ab2"):  # a change vs its parent, one call
        new, old = runs.get(f"{ab}_new"), runs.get(f"{ab}_base")
        if new and old and new.get("sustained_by_senders") and old.get("sustained_by_senders"):
            commits = f"{new['meta'].get('commit', '?')} vs {old['meta'].get('commit', '?')}"
            row(f"same node one-page transfers/s: {commits}, same device call", f"{ab}_new",
                _sustained(new)[1], _sustained(old)[1], None)  # fmt: skip
    for tag in ("64k", "1m", "64m"):
        j, nl = (
            runs.get(f"transfer_same_node_gpu_delta_{tag}"),
            runs.get(f"transfer_same_node_gpu_nolane_delta_{tag}"),
        )
        same_card = j and nl and j.get("meta", {}).get("gpu") == nl.get("meta", {}).get("gpu")
        if j and nl and _p50(j) and _p50(nl) and same_card:  # never across two machines
            row(f"same node {tag}: the native lane vs the gRPC route", f"transfer_same_node_gpu_nolane_delta_{tag}",
                f"{_p50(j):.3f} ms (lane)", f"{_p50(nl):.3f} ms (gRPC route, --no-lane)", None)  # fmt: skip
    # issue 32: GPU0 -> GPU1 on one host (two-GPU machine)
    share_row("same node GPU0 -> GPU1, one service, 2 GiB >= 90% of the peer copy",
              latest("transfer_same_node_gpu0to1", "transfer_same_node_gpu0to1_lane", "transfer_same_node_gpu0to1_lane_push_16",
                     "transfer_same_node_gpu0to1_lane_spin", "transfer_same_node_gpu0to1_lane_confirm",
                     "transfer_same_node_gpu0to1_lane_final"),
              "contiguous_copy", "peer copy", 0.90)  # fmt: skip
    pairs = {
        "transfer_same_node_gpu0to1_delta_64k_lane": "transfer_same_node_gpu_delta_64k_x2host_b",
        "transfer_same_node_gpu0to1_delta_64k_lane_r1": "transfer_same_node_gpu_delta_64k_x2host_r1",
        "transfer_same_node_gpu0to1_delta_64k_lane_r2": "transfer_same_node_gpu_delta_64k_x2host_r2",
    }
    lane = latest(*pairs)  # the earlier repeats: NOTES.md
    if lane:
        a, b = runs.get(lane), runs.get(pairs[lane])
        if a and b and _p50(a) and _p50(b):
            gap = (_p50(a) - _p50(b)) * 1e3
            row("one page GPU0 -> GPU1 (lane) within 50 µs of the same GPU", lane, f"{_p50(a):.3f} ms ({gap:+.0f} µs)",
                f"same GPU {_p50(b):.3f} ms", gap <= 50)  # fmt: skip
    # the gRPC route's modes: measured before the lane took two GPUs (no --no-lane needed then)
    modes = {
        m: runs.get(latest(f"transfer_same_node_gpu0to1_{m}", f"transfer_same_node_gpu0to1_nolane_{m}"))
        for m in ("push", "pull", "staged")
    }
    if all(modes.values()):
        copy = {m: j["kvservice"]["auto"]["phases_us_median"]["wire"] / 1e3 for m, j in modes.items()}
        row("GPU0 -> GPU1 2 GiB, gRPC route (--no-lane) push / pull / staged: copy phase (e2e)", "transfer_same_node_gpu0to1_staged",
            " / ".join(f"{copy[m]:.2f} ({_p50(j):.2f})" for m, j in modes.items()) + " ms",
            f"fused kernel alone {_base(modes['push'], 'fused_kernel_only'):.2f} ms", None)  # fmt: skip
    # the streamed cross-node lane at its defaults, five runs over three device sessions
    median_row("GPU0 -> GPU1, two services on the host, 2 GiB >= 90% of the peer copy",
               tuple(f"transfer_gpu0to1_svc2_{t}" for t in ("p4", "1g", "final", "final1", "final2")),
               "contiguous_copy", "peer copy", 0.90)  # fmt: skip
    two = [runs.get(f"transfer_gpu0to1_svc2_{m}") for m in ("push", "pull")]
    if all(two) and _p50(two[0]) and _p50(two[1]):
        row("GPU0 -> GPU1, two services, 2 GiB: push / pull", "transfer_gpu0to1_svc2_pull",
            f"{_p50(two[0]):.2f} / {_p50(two[1]):.2f} ms", "peer copy: see the one-service row (same session)",
            None)  # fmt: skip
    share_row("cross-node route GPU0 -> GPU1, 2 GiB >= 85% of NIXL 1 desc",
              latest("transfer_gpu0to1_xnode", "transfer_gpu0to1_xnode_lane_stream", "transfer_gpu0to1_xnode_lane_stream_p4",
                     "transfer_gpu0to1_xnode_lane_stream_confirm", "transfer_gpu0to1_xnode_lane_stream_final"),
              "raw_nixl_one_descriptor", "NIXL 1 desc", 0.85)  # fmt: skip
    for run in ("launch_gpu_64k", "launch_gpu_2m"):
        j = runs.get(run)
        if j:
            r = j["rows"]
            row("floor: one fused launch from Python (no service)", run,
                f"launch {r['launch_fused']['p50_ms'] * 1e3:.0f} µs; launch + completion thread {r['completion_loop']['p50_ms'] * 1e3:.0f} µs",
                f"sync {r['fused_sync']['p50_ms'] * 1e3:.0f} µs", None)  # fmt: skip

    def mixed_row(
        run: str, configs: tuple[str, str], goal: str, label: str, at_least: float | None = 0.80
    ) -> bool:
        """2 GiB of mixed TP beside a copy of the same bytes (bench_mixed_tp.py --tag 2g...)."""
        j = runs.get(run)
        c = j["configs"] if j else {}
        got = {k: c[k] for k in configs if k in c and "fraction_of_contiguous_copy" in c[k]}
        if not got:
            return False
        worst = min(e["fraction_of_contiguous_copy"] for e in got.values())
        env = j.get("meta", {}).get("service_env") or {}  # type: ignore[union-attr]
        how = "one service, the lane" if j.get("same_node") else "two services"  # type: ignore[union-attr]
        knobs = "".join(f"; {k}={v}" for k, v in sorted(env.items()))
        value = (
            " / ".join(
                f"{k} {e['kvservice']['p50_ms']:.2f} ms ({e['fraction_of_contiguous_copy']:.1%})"
                for k, e in got.items()
            )
            + f" ({how}{knobs})"
        )
        base = f"{label} {j['baselines']['contiguous_copy']['p50_ms']:.2f} ms"  # type: ignore[index]
        row(goal, run, value, base, None if at_least is None else worst >= at_least)
        return True

    one_gpu = latest("mixed_tp_gpu_2g", "mixed_tp_gpu_2g_lane", "mixed_tp_gpu_2g_lane_spin", "mixed_tp_gpu_2g_lane_pipe",
                     "mixed_tp_gpu_2g_lane_pipe_spin", "mixed_tp_gpu_2g_lane_spin_final", "mixed_tp_gpu_2g_lane_fast",
                     "mixed_tp_gpu_2g_lane_shape2", "mixed_tp_gpu_2g_lane_auto", "mixed_tp_gpu_2g_lane_fin29b")  # fmt: skip
    if not mixed_row(one_gpu, ("4->2", "2->1"), "mixed TP 4->2 and 2->1 on one GPU, 2 GiB >= 80% of a device copy", "copy") and runs.get("mixed_tp_gpu"):  # fmt: skip
        c = runs["mixed_tp_gpu"]["configs"]  # the goal's run was never made: say what there is
        value = " / ".join(f"{k} {c[k]['kvservice']['p50_ms']:.2f} ms" for k in ("4->2", "2->1") if k in c)
        rows.append(f"| mixed TP 4->2 and 2->1 on one GPU, 2 GiB >= 80% of a device copy | mixed_tp_gpu (H200) "
                    f"| {runs['mixed_tp_gpu']['bytes'] >> 20} MiB only: {value} | (no copy baseline in that run) | **not measured** |")  # fmt: skip
    mixed_row(latest("mixed_tp_gpu0to1_2g", "mixed_tp_gpu0to1_2g_lane_spin", "mixed_tp_gpu0to1_2g_lane", "mixed_tp_gpu0to1_2g_lane_final"), ("2->4", "4->2"),
              "mixed TP 2->4 and 4->2 across GPU0 -> GPU1, 2 GiB >= 80% of the peer copy", "peer copy")  # fmt: skip
    # the same rows' earlier routes and settings, each beside its own same-run copy
    mixed_row("mixed_tp_gpu_2g", ("4->2", "2->1"), "mixed TP one GPU, 2 GiB: two services (gRPC fused route over CUDA IPC)", "copy", None)  # fmt: skip
    mixed_row("mixed_tp_gpu_2g_lane", ("4->2", "2->1"), "mixed TP one GPU, 2 GiB: the lane, each copy waited for", "copy", None)  # fmt: skip
    mixed_row("mixed_tp_gpu_2g_lane_pipe", ("4->2", "2->1"), "mixed TP one GPU, 2 GiB: the lane, launches pipelined, no spin", "copy", None)  # fmt: skip
    mixed_row("mixed_tp_gpu0to1_2g", ("2->4", "4->2"), "mixed TP GPU0 -> GPU1, 2 GiB: two services (gRPC route)", "peer copy", None)  # fmt: skip
    mixed_row("mixed_tp_gpu_2g_lane_shape", ("4->2", "2->1"), "mixed TP one GPU, 2 GiB: every copy at 512 threads a block (not taken: head slices lose)", "copy", None)  # fmt: skip
    _cpu_goals(runs, latest, row)
    if not rows and not compare:
        return []
    head = ["| goal | run | kvservice p50 | same-run baseline | status |", "|---|---|---|---|---|"]
    return [
        "## Goals (issues 28 and 32): the latest figure per goal, baseline from the same run",
        "",
        *head,
        *rows,
        "",
        "## Same-run comparisons (A/B of a change, the lanes vs the gRPC route, floors)",
        "",
        *head,
        *compare,
        "",
        "Runs before data path v3 on the same machine kind: the `*_before_v3.json` files (NOTES.md).",
        "",
    ]


def _cpu_goals(runs: dict[str, dict], latest: Any, row: Any) -> None:
    """Issue 28's CPU goals (the 2-core VM, shm pools, same node): one-page e2e <= 2x a plain
    unary RPC of the same run, >= 800 one-page transfers/s with 8 senders, a large same-node
    transfer >= 90% of memcpy."""
    ctl = [n for n in runs if n.startswith("control_same_node_cpu") and "nolane" not in n]
    name = latest(*ctl) if ctl else ""
    j = runs.get(name)
    if j and "unary_rpc" in j["rpc"]:
        e2e, unary = j["rpc"]["transfer_e2e"]["p50_ms"], j["rpc"]["unary_rpc"]["p50_ms"]
        row("CPU one-page e2e <= 2x a plain unary RPC", name, f"{e2e:.3f} ms ({e2e / unary:.2f}x)",
            f"health check {unary:.3f} ms", e2e <= 2 * unary)  # fmt: skip
    if j:
        rates = [r["transfers_per_s"] for r in j["sustained_by_senders"] if r["threads"] == 8]
        rates += [r["transfers_per_s"] for r in j.get("sustained_by_engine_pairs", []) if r["senders"] == 8]
        if rates:
            row("CPU one-page transfers/s, 8 senders >= 800", name, f"{max(rates):.0f}/s",
                "(a rate: no baseline)", max(rates) >= 800)  # fmt: skip
    big = [
        n
        for n, v in runs.items()
        if v["benchmark"] == "transfer"
        and "nolane" not in n  # the default route's figure (the gRPC route's: same-run comparison)
        and v.get("device") == "cpu"
        and v.get("same_node")
        and v["bytes"] >= 256 << 20
    ]
    if big:
        run = latest(*big)
        share_of = runs[run]["ratios"]["auto"].get("fraction_of_contiguous_copy")
        copy = _base(runs[run], "contiguous_copy")
        if share_of is not None and copy:
            row("CPU same node (shm) 256 MiB >= 90% of memcpy", run, f"{_p50(runs[run]):.1f} ms ({share_of:.0%})",
                f"memcpy {copy:.1f} ms", share_of >= 0.90)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    d = Path(args.results)
    runs = {k: v for k, v in _load(d).items() if "_small" not in k}
    for name, j in runs.items():
        if j["benchmark"] == "transfer":
            _borrow_baselines(name, j, runs)
    lines = [
        "# Benchmark summary",
        "",
        "Generated by `bench/report.py` from the JSON files here (hand-written notes: NOTES.md, below).",
        "",
    ]
    lines += _headline(runs)
    lines += ["## Every run against the first round's goals (history)", "", GOALS, ""]
    lines += _goals(runs)[1:]
    notes = d / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text(), ""]
    for kind, title, fn in (
        ("transfer", "Scattered delta, same TP", _transfer),
        ("mixed_tp", "Mixed TP", _mixed),
        ("multiturn", "Multi-turn workload", _multi),
        ("control", "Control plane", _control),
        ("routing", "KV-centric P/D routing (seed 002)", _routing),
    ):
        sel = {k: v for k, v in runs.items() if v["benchmark"] == kind}
        if sel:
            lines += [f"## {title}", ""]
            for name, j in sel.items():
                lines += fn(name, j)
                lines += [f"![{name}]({name}.png)", ""]
    for name, j in runs.items():
        if j["benchmark"] == "convert":
            lines += ["## Cross-engine conversion (page size, page layout)", "", *_convert(name, j)]
    plots = _plots(d, {k: v for k, v in runs.items() if v["benchmark"] != "ab"})  # A/Bs: NOTES.md
    (d / "SUMMARY.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {d / 'SUMMARY.md'} and {len(plots)} plots")


if __name__ == "__main__":
    main()
