"""`tracesynth demo`: the main job on the data the project ships (grows with the pipeline)."""

from __future__ import annotations

from pathlib import Path

import typer

from tracesynth.cli.app import app, console
from tracesynth.io import read_trace

REPO = Path(__file__).resolve().parents[3]
SHARED_TRACE = REPO.parent / "shared" / "traces" / "lttng-wget-kernel"


@app.command()
def demo(out: Path = typer.Option(Path("out/demo"), "-o", "--out", help="Where outputs go.")) -> None:
    """Run the pipeline on the shipped traces and print where the results are."""
    sources = sorted((REPO / "data").glob("*.parquet"))
    if SHARED_TRACE.exists():
        sources.insert(0, SHARED_TRACE)
    if not sources:
        console.print("demo: no shipped traces found under data/ (and ../shared is absent)")
        raise typer.Exit(1)
    out.mkdir(parents=True, exist_ok=True)
    for src in sources:
        trace = read_trace(src)
        dest = out / f"{src.stem if src.is_file() else src.name}.parquet"
        trace.save(dest)
        s = trace.summary()
        top = ", ".join(f"{k} {v:,}" for k, v in list(trace.event_counts().items())[:5])
        console.print(f"{src.name}: {s['events']:,} events, {s['event_types']} types, {s['duration_s']:.2f} s; {top}")
    console.print(f"demo: traces written under {out}/")
