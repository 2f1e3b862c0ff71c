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
) -> None:
    """Summarise traces: events, duration, event-type histogram, threads, CPUs."""
    out = Console()  # the summary is the output: stdout
    for path in paths:
        trace = read_trace(path)
        s = trace.summary()
        out.print(f"[bold]{path}[/]  {s['events']:,} events over {s['duration_s']:.3f} s")
        meta = ", ".join(f"{k}={v}" for k, v in sorted(s["metadata"].items()))
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
