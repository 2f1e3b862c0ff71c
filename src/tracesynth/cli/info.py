"""`tracesynth info`: a readable summary of one or more traces."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tracesynth.cli.app import app
from tracesynth.io import read_trace


@app.command()
def info(
    paths: list[Path] = typer.Argument(..., help="Traces (Parquet, or any readable format)."),
    top: int = typer.Option(15, "--top", help="How many event types to list."),
    profile: bool = typer.Option(
        True, "--profile/--no-profile", help="Per-workload profile: event families, syscall latency, switches."
    ),
) -> None:
    """Summarise traces: events, duration, event-type histogram, threads, CPUs, and a workload profile.

    The profile (tracesynth.stats) shows how workloads differ: the share of syscall, scheduler,
    fault, irq and timer events, entry->exit syscall latency quantiles per thread (p50/p90/p99),
    and context switches per second. With several traces a comparison table closes the output.
    """
    out = Console()  # the summary is the output: stdout
    summaries = []
    for path in paths:
        trace = read_trace(path)
        s = trace.summary()
        out.print(f"[bold]{path}[/]  {s['events']:,} events over {s['duration_s']:.3f} s")
        meta = ", ".join(f"{k}={v}" for k, v in sorted(s["metadata"].items()) if len(str(v)) <= 80)
        if meta:
            out.print(f"  {meta}")
        out.print(
            f"  {s['event_types']} event types, {len(s['cpus'])} CPUs {s['cpus']}, {s['threads']} threads, "
            f"{len(s['commands'])} commands; tid known on {s['with_tid']:,}, ret on {s['with_ret']:,} events"
        )
        table = Table("event", "count", "share", box=None, pad_edge=False)
        for name, count in list(trace.event_counts().items())[:top]:
            table.add_row(name, f"{count:,}", f"{count / max(1, s['events']):.1%}")
        out.print(table)
        if profile:
            from tracesynth.stats import summarize

            w = summarize(trace)
            summaries.append((path, w))
            _print_profile(out, w)
    if len(summaries) > 1:
        _print_comparison(out, summaries)


def _us(ns: float) -> str:
    return f"{ns / 1e3:,.1f}"


def _print_profile(out: Console, w) -> None:  # noqa: ANN001  (a tracesynth.stats.WorkloadSummary)
    fams = ", ".join(f"{f} {share:.1%}" for f, share in w.families.items() if share > 0)
    out.print(f"  profile: {fams}")
    out.print(f"  {w.context_switches_per_s:,.1f} context switches/s, {w.syscalls_per_s:,.1f} syscalls/s")
    if w.syscall_latency is None:
        out.print("  no syscall entry/exit pairs")
        return
    table = Table("syscall latency (µs)", "pairs", "p50", "p90", "p99", box=None, pad_edge=False)
    for q in [w.syscall_latency, *w.top_syscall_latency]:
        table.add_row(q.name, f"{q.count:,}", _us(q.p50_ns), _us(q.p90_ns), _us(q.p99_ns))
    out.print(table)


def _print_comparison(out: Console, summaries: list) -> None:
    out.print("[bold]workload comparison[/] (event-family shares, context switches/s, syscall latency µs)")
    table = Table("workload", "events", "types", "sys", "sched", "fault", "irq/tmr", "sw/s", "p50", "p99", box=None)
    for path, w in summaries:
        lat = w.syscall_latency
        f = w.families
        name = w.workload if w.workload != "?" else Path(path).name
        table.add_row(
            name[:16],
            f"{w.events:,}",
            str(w.event_types),
            f"{f['syscall']:.0%}",
            f"{f['sched']:.0%}",
            f"{f['fault']:.0%}",
            f"{f['irq'] + f['timer']:.0%}",
            f"{w.context_switches_per_s:,.0f}",
            _us(lat.p50_ns) if lat else "-",
            _us(lat.p99_ns) if lat else "-",
        )
    out.print(table)
