"""`tracesynth collect` (record a real kernel trace of a workload) and `tracesynth datasets`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tracesynth.cli.app import app, console
from tracesynth.errors import TraceSynthError


def _collect_one(
    workload: str | None,
    command: str | None,
    output: Path,
    duration: float | None,
    keep_perf: Path | None,
    target_events: int | None = None,
) -> None:
    from tracesynth.collect import collect

    label = workload or "command"
    with Progress(
        TextColumn(f"[bold]tracing {label}[/]"),
        BarColumn(),
        TextColumn("{task.fields[elapsed]:.0f}/{task.fields[limit]} s"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        limit = duration if duration else None
        if workload is not None and duration is None:
            from tracesynth.workloads import get_workload

            limit = get_workload(workload).duration
        task = bar.add_task("run", total=limit or None, elapsed=0.0, limit=f"{limit:g}" if limit else "?")

        def tick(elapsed: float) -> None:
            bar.update(task, completed=min(elapsed, limit or elapsed), elapsed=elapsed)

        trace = collect(
            command=command,
            workload=workload,
            output=output,
            duration=duration,
            keep_perf_data=keep_perf,
            progress=tick,
            target_events=target_events,
        )
    console.print(
        f"{output}: {len(trace):,} events, {trace.n_event_types} event types over {trace.duration_ns / 1e9:.2f} s"
        + (
            f" ([yellow]perf lost {trace.metadata['lost_chunks']} chunks[/])"
            if trace.metadata.get("lost_chunks")
            else ""
        )
    )


@app.command()
def collect(
    workload: str = typer.Argument(None, help="A catalogue workload (see `tracesynth datasets --catalogue`)."),
    command: str = typer.Option(None, "--command", "-c", help="Trace this shell command instead of a catalogue entry."),
    output: Path = typer.Option(None, "--output", "-o", help="Parquet trace to write."),
    duration: float = typer.Option(
        None,
        "--duration",
        "-d",
        help="Stop the workload after S seconds (default: the entry's own; 0 = to completion).",
    ),
    dataset: Path = typer.Option(
        None, "--dataset", help="Write DIR/<workload>.parquet and record it in DIR/manifest.json."
    ),
    keep_perf_data: Path = typer.Option(None, "--perf-data", help="Also keep the raw perf.data here."),
    events: int = typer.Option(
        None, "--events", "-n", help="Stop once about N events are recorded (estimated from perf.data's size)."
    ),
) -> None:
    """Record a real kernel trace of a workload with perf (its process tree only) and ingest it.

    Tracepoints: sched_switch/wakeup/process_*, raw_syscalls (names from the syscall table),
    user page faults, irq/softirq and hrtimer events. Needs perf (apt-get install linux-perf) and
    tracepoint access (root, or kernel.perf_event_paranoid=-1).
    """
    if workload is None and command is None:
        raise TraceSynthError("name a catalogue workload or give --command (see `tracesynth datasets --catalogue`)")
    if workload is not None and command is not None:
        raise TraceSynthError("name a catalogue workload or give --command, not both")
    if dataset is not None:
        if workload is None:
            raise TraceSynthError("--dataset records catalogue workloads only")
        output = output or dataset / f"{workload}.parquet"
    if output is None:
        raise TraceSynthError("say where to write the trace: -o trace.parquet (or --dataset DIR)")
    _collect_one(workload, command, output, duration, keep_perf_data, events)
    if dataset is not None:
        from tracesynth.collect import add_to_dataset

        entry = add_to_dataset(dataset, output)
        console.print(f"{dataset / 'manifest.json'}: recorded {entry['file']} (sha256 {entry['sha256'][:12]}...)")


@app.command()
def datasets(
    directory: Path = typer.Option(
        None, "--dir", help="Dataset directory (default: $TRACESYNTH_DATA, ./data, the checkout's data/)."
    ),
    catalogue: bool = typer.Option(False, "--catalogue", help="List the workload catalogue instead."),
    build: bool = typer.Option(False, "--build", help="Collect every catalogue workload into the directory."),
    only: list[str] = typer.Option(None, "--only", help="With --build: just these workloads."),
    events: int = typer.Option(300_000, "--events", "-n", help="With --build: about this many events per trace."),
    max_duration: float = typer.Option(600, "--max-duration", help="With --build: stop each workload by then (s)."),
) -> None:
    """List the shipped dataset (data/manifest.json), the workload catalogue, or (re)build the dataset."""
    from tracesynth.collect import add_to_dataset, read_manifest
    from tracesynth.workloads import CATALOGUE, get_workload

    out = Console()
    if directory is None:
        from tracesynth.resources import dataset_dir, default_dataset_output

        directory = default_dataset_output() if build else dataset_dir()
    if catalogue:
        table = Table("workload", "kind", "package", "duration", "what it runs", box=None, pad_edge=False)
        for w in CATALOGUE.values():
            table.add_row(w.name, w.kind, w.package, f"{w.duration:g} s" if w.duration else "to end", w.description)
        out.print(table)
        return
    if build:
        for name in only or list(CATALOGUE):
            get_workload(name)
            path = directory / f"{name}.parquet"
            _collect_one(name, None, path, max_duration, None, events)
            add_to_dataset(directory, path)
    doc = read_manifest(directory)
    if not doc["traces"]:
        raise TraceSynthError(
            "no dataset here (no manifest.json); build one with `tracesynth datasets --build`", directory
        )
    table = Table("file", "events", "types", "seconds", "MB", "most common event", box=None)
    total = 0
    for t in doc["traces"]:
        counts = t.get("event_counts", [])
        top = f"{counts[0][0]} {counts[0][1] / max(1, t['events']):.0%}" if counts else "-"
        total += t.get("bytes", 0)
        table.add_row(
            t["file"],
            f"{t['events']:,}",
            str(t["event_types"]),
            f"{t['duration_s']:.1f}",
            f"{t.get('bytes', 0) / 1e6:.1f}",
            top,
        )
    out.print(table)
    out.print(
        f"{len(doc['traces'])} traces, {total / 1e6:.1f} MB in {directory} (kernel {doc['traces'][0].get('kernel')})"
    )
