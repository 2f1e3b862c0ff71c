"""ingest / export / anonymize: real traces in, the Trace table out, and back to trace formats."""

from __future__ import annotations

from pathlib import Path

import typer

from tracesynth.cli.app import app, console
from tracesynth.io import FORMATS, read_trace


@app.command()
def ingest(
    path: Path = typer.Argument(..., help="Trace: LTTng/perf CTF directory, perf.data, perf script or strace text."),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet file to write."),
    format: str = typer.Option(None, "--format", help=f"Force a format: {', '.join(FORMATS)}."),
    workload: str = typer.Option(None, "--workload", help="Workload name stored in the trace metadata."),
) -> None:
    """Read a real trace into the Trace table (Parquet)."""
    trace = read_trace(path, format)
    if workload:
        trace.metadata["workload"] = workload
    trace.save(output)
    s = trace.summary()
    console.print(
        f"{path} -> {output}: {s['events']:,} events, {s['event_types']} event types, "
        f"{s['duration_s']:.3f} s, {len(s['cpus'])} CPUs, {s['threads']} threads"
    )
