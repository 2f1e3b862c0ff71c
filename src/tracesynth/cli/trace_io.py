"""ingest / export / anonymize: real traces in, the Trace table out, and back to trace formats."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from tracesynth.cli.app import app, console
from tracesynth.errors import TraceSynthError
from tracesynth.io import FORMATS, read_trace
from tracesynth.trace import Trace

EXPORT_FORMATS = ("ctf", "parquet")


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A live count of events read while a CTF trace streams through babeltrace2."""
    from tracesynth.io.babeltrace import progress_callback

    with Progress(
        SpinnerColumn(),
        TextColumn("reading {task.description}"),
        TextColumn("{task.completed:,} events"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(str(path), total=None)
        token = progress_callback.set(lambda n: bar.advance(task, n))
        try:
            yield
        finally:
            progress_callback.reset(token)


def _read(path: Path, format: str | None) -> Trace:
    if format is not None and format not in FORMATS:
        raise TraceSynthError(f"unknown format {format!r} (choose from {', '.join(FORMATS)})")
    with _reading(path):
        trace = read_trace(path, format)
    if len(trace) == 0:
        raise TraceSynthError("the trace holds no events", path)
    return trace


def _describe(trace: Trace) -> str:
    s = trace.summary()
    return (
        f"{s['events']:,} events, {s['event_types']} event types, {s['duration_s']:.3f} s, "
        f"{len(s['cpus'])} CPUs, {s['threads']} threads"
    )


@app.command()
def ingest(
    path: Path = typer.Argument(..., help="Trace: LTTng/perf CTF directory, perf.data, perf script or strace text."),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet file to write."),
    format: str = typer.Option(None, "--format", help=f"Force a format: {', '.join(FORMATS)}."),
    workload: str = typer.Option(None, "--workload", help="Workload name stored in the trace metadata."),
    decoder: str = typer.Option(
        None, "--decoder", help="CTF decoder: native (default; CTF 1.8 and 2) or babeltrace2 (its text; CTF 1.8)."
    ),
) -> None:
    """Read a real trace into the Trace table (Parquet)."""
    from tracesynth.io.babeltrace import ctf_decoder, selected_decoder

    token = ctf_decoder.set(decoder)
    try:
        selected_decoder()  # an unknown name fails before the trace is read
        trace = _read(path, format)
    finally:
        ctf_decoder.reset(token)
    if workload:
        trace.metadata["workload"] = workload
    trace.save(output)
    console.print(f"{path} -> {output}: {_describe(trace)}", soft_wrap=True)


@app.command()
def export(
    trace_path: Path = typer.Argument(..., help="Trace to export (Parquet, or any readable format)."),
    output: Path = typer.Argument(..., help="Output: a directory for CTF, a file for Parquet."),
    to: str = typer.Option("ctf", "--to", help=f"Output format: {', '.join(EXPORT_FORMATS)}."),
    format: str = typer.Option(None, "--format", help="Force the input format (default: detect)."),
    ctf_version: str = typer.Option(
        "1.8", "--ctf-version", help="CTF 1.8 (Debian's babeltrace2, Trace Compass) or 2 (LTTng 2.15's default)."
    ),
) -> None:
    """Write a trace as LTTng-style kernel CTF (babeltrace2 reads it back) or as Parquet."""
    if to not in EXPORT_FORMATS:
        raise TraceSynthError(f"unknown export format {to!r} (choose from {', '.join(EXPORT_FORMATS)})")
    if ctf_version not in ("1.8", "2"):
        raise TraceSynthError(f"unknown CTF version {ctf_version!r} (choose from 1.8, 2)")
    trace = _read(trace_path, format)
    if to == "parquet":
        trace.save(output)
    else:
        from tracesynth.io.ctf_writer import write_ctf

        with Progress(
            TextColumn("writing CTF"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("write", total=len(trace))
            write_ctf(trace, output, on_progress=lambda n: bar.advance(task, n), ctf_version=ctf_version)
    console.print(f"{trace_path} -> {output} ({to}): {_describe(trace)}", soft_wrap=True)


def salt_or_random(salt: str | None) -> str:
    """The given salt, or a random one (said on stderr: its labels match no other run)."""
    if salt:
        return salt
    console.print("no --salt given: using a random one (labels will differ from other runs)", soft_wrap=True)
    return secrets.token_hex(16)


@app.command()
def anonymize(
    trace_path: Path = typer.Argument(..., help="Trace to anonymise (Parquet, or any readable format)."),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet file to write."),
    salt: str = typer.Option(
        None, "--salt", envvar="TRACESYNTH_SALT", help="Secret salt for comm hashes (same salt = same labels)."
    ),
    format: str = typer.Option(None, "--format", help="Force the input format (default: detect)."),
    shift_time: bool = typer.Option(
        False,
        "--shift-time",
        help="Also shift timestamps so the trace starts at 0 (and drop the clock offset): hides when it was "
        "recorded; intervals between events are unchanged.",
    ),
) -> None:
    """Hash command names, relabel thread ids (and the ids syscalls return) and drop paths/hosts from metadata."""
    from tracesynth.anonymize import anonymize as anonymize_trace

    trace = _read(trace_path, format)
    anonymize_trace(trace, salt_or_random(salt), shift_time=shift_time).save(output)
    console.print(f"{trace_path} -> {output} (anonymised): {_describe(trace)}", soft_wrap=True)
