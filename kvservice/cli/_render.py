"""A ``GetStatsResponse`` as rich renderables: one table per concern, the same for status and top.

Rates come from the response's activity window (transfers and bytes of transfers that ended in
the last ``window_ms``), so one snapshot is enough: ``status`` needs no second sample.
"""

from __future__ import annotations

from kvservice_client.proto import kvservice_pb2 as pb
from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

__all__ = ["human_bytes", "human_us", "render"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_us(us: int) -> str:
    if not us:
        return "-"
    return f"{us} µs" if us < 1000 else f"{us / 1000:.2f} ms" if us < 1_000_000 else f"{us / 1e6:.2f} s"


def _uptime(ms: int) -> str:
    s = ms // 1000
    return f"{s // 86400}d {s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def _table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    return t


def header(s: pb.GetStatsResponse, address: str) -> Panel:
    t = s.transfers
    ix = s.index
    hit = f"{100 * ix.hit_pages / ix.query_pages:.1f}%" if ix.query_pages else "-"
    view = "[green]admin view[/]" if s.admin_view else "[yellow]scoped view[/]"
    lines = [
        f"[bold]{s.service_id}[/] v{s.version} at {address}  up {_uptime(s.uptime_ms)}  {view}",
        f"sessions {s.sessions}  buffer sets {s.buffer_sets_total}  index {ix.entries} pages, "
        f"{ix.leases} leases, hit {hit}  transfers: {t.in_flight} in flight, {t.done} done, "
        f"{t.failed} failed, {t.aborted} aborted",
    ]
    lines.append(_tier_line(s.tier))
    if s.scope_note:
        lines.append(f"[yellow]{s.scope_note}[/]")
    return Panel("\n".join(lines), title="kvservice", title_align="left")


def _tier_line(tr: pb.TierStats) -> str:
    """The host tier in one line: size, pages, hit rate, evictions, fill backlog."""
    if not tr.capacity_bytes:
        return "host tier [dim]off[/]"
    asked = tr.hit_pages + tr.miss_pages
    hit = f"{100 * tr.hit_pages / asked:.1f}%" if asked else "-"
    return (
        f"host tier {human_bytes(tr.used_bytes)} / {human_bytes(tr.capacity_bytes)}, {tr.held_pages} pages "
        f"in {tr.layouts} layouts, hit {hit}, {tr.evicted_pages} evicted, {tr.loaded_pages} loaded, "
        f"fill backlog {tr.fill_backlog_pages} pages"
    )


def routes(s: pb.GetStatsResponse) -> Table:
    win = max(s.activity.window_ms, 1) / 1000
    t = _table(
        f"Routes (last {win:.0f} s)",
        "role/route",
        "xfer/s",
        "bytes/s",
        "done",
        "failed",
        "p50",
        "p99",
        "total",
    )
    for r in s.activity.routes:
        t.add_row(
            f"{r.role}/{r.route}",
            f"{r.done / win:.1f}",
            human_bytes(r.bytes / win) + "/s",
            str(r.done),
            Text(str(r.failed), style="red" if r.failed else ""),
            human_us(r.p50_us),
            human_us(r.p99_us),
            f"{r.done_total} / {human_bytes(r.bytes_total)}",
        )
    return t


def in_flight(s: pb.GetStatsResponse) -> Table:
    t = _table("In flight by phase", "role", "phase", "transfers", "moved")
    for g in s.in_flight:
        t.add_row(g.role, g.phase, str(g.transfers), human_bytes(g.bytes))
    if not s.in_flight:
        t.add_row(Text("none", style="dim"), "", "", "")
    return t


def _budget(ld: pb.TransferLoad) -> str:
    transfers = str(ld.inbound_max_transfers) if ld.inbound_max_transfers else "∞"
    nbytes = human_bytes(ld.inbound_max_bytes) if ld.inbound_max_bytes else "∞"
    return f"{transfers} / {nbytes}"


def engines(s: pb.GetStatsResponse) -> Table:
    t = _table(
        "Engines",
        "engine",
        "buffer set",
        "inbound",
        "pending",
        "outbound",
        "budget",
        "refused",
        "p50/p99 in",
        "indexed",
    )
    for b in sorted(s.buffer_sets, key=lambda b: (b.engine_id, b.buffer_set_id)):
        ld = b.load
        budget = _budget(ld)
        t.add_row(
            b.engine_id or "-",
            b.buffer_set_id[:12],
            str(ld.inbound_transfers),
            human_bytes(ld.inbound_bytes_pending),
            str(ld.outbound_transfers),
            Text(budget, style="" if ld.admits else "red"),
            str(ld.inbound_refused),
            f"{human_us(ld.inbound_p50_us)} / {human_us(ld.inbound_p99_us)}",
            str(b.indexed_pages),
        )
    return t


def staging(s: pb.GetStatsResponse) -> Table:
    t = _table("Staging", "pool", "used", "capacity", "slots", "waiters")
    for p in s.staging:
        t.add_row(
            p.kind,
            human_bytes(p.used_bytes),
            human_bytes(p.capacity_bytes),
            str(p.slots_in_use),
            Text(str(p.waiters), style="red" if p.waiters else ""),
        )
    return t


def peers(s: pb.GetStatsResponse) -> Table:
    t = _table("Peers", "address", "service", "channel", "stream", "rtt", "queued")
    for p in s.peers:
        style = (
            "green" if p.channel_state == "READY" else "red" if p.channel_state == "TRANSIENT_FAILURE" else ""
        )
        t.add_row(
            p.address + (" (self)" if p.is_self else ""),
            p.service_id or "-",
            Text(p.channel_state or "?", style=style),
            "open" if p.stream_open else "closed",
            human_us(p.rtt_us),
            str(p.queue_depth),
        )
    return t


def sessions(s: pb.GetStatsResponse) -> Table:
    t = _table("Sessions", "client", "session", "state", "uid", "admin", "buffer sets", "transfers")
    for x in s.session_list:
        t.add_row(
            x.client_name or "-",
            x.session_ref,
            "attached" if x.attached else Text("detached", style="yellow"),
            str(x.uid) if x.uid >= 0 else "-",
            "yes" if x.admin else "",
            str(x.buffer_sets),
            str(x.transfers_in_flight),
        )
    return t


def render(s: pb.GetStatsResponse, address: str) -> RenderableType:
    """Everything, top to bottom: header, routes, in flight, engines, staging, peers, sessions."""
    parts: list[RenderableType] = [header(s, address), routes(s), in_flight(s), engines(s), staging(s)]
    if s.admin_view:
        parts.append(peers(s))
    parts.append(sessions(s))
    return Group(*parts)
