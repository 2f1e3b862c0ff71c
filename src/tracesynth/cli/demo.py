"""`tracesynth demo`: the main job on the data the project ships.

Runs the whole pipeline (train the diffusion model and the Markov baseline, sample, repair,
evaluate, report) on the shipped dataset under data/, as configured by configs/demo.json.
"""

from __future__ import annotations

from pathlib import Path

import typer

from tracesynth.cli.app import app, console
from tracesynth.errors import TraceSynthError

REPO = Path(__file__).resolve().parents[3]
DEMO_CONFIG = REPO / "configs" / "demo.json"


@app.command()
def demo(
    out: Path = typer.Option(Path("out/tracesynth-demo"), "-o", "--out", help="Output directory."),
    config: Path = typer.Option(DEMO_CONFIG, "--config", help="Pipeline config to run."),
) -> None:
    """Run the whole pipeline on the shipped dataset and print where the report is."""
    from tracesynth.evaluate.pipeline import run_pipeline

    if not config.is_file():
        raise TraceSynthError("demo config not found (run from a full checkout of the repository)", config)
    report = run_pipeline(config, out, console=console)
    console.print(f"[bold]tracesynth report:[/] {report}")
