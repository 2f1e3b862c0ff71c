"""`tracesynth demo`: the main job on the data the project ships.

Runs the whole pipeline (train the diffusion model and the Markov baseline, sample, repair,
evaluate, report) on the shipped dataset under data/, as configured by the shipped configs/demo.json.
"""

from __future__ import annotations

from pathlib import Path

import typer

from tracesynth.cli.app import app, console
from tracesynth.errors import TraceSynthError
from tracesynth.resources import configs_dir

DEMO_CONFIG = configs_dir() / "demo.json"


@app.command()
def demo(
    out: Path = typer.Option(Path("out/tracesynth-demo"), "-o", "--out", help="Output directory."),
    config: Path = typer.Option(DEMO_CONFIG, "--config", help="Pipeline config to run."),
    data: Path = typer.Option(
        None, "--data", help="Dataset directory (default: $TRACESYNTH_DATA, ./data, or the checkout's data/)."
    ),
) -> None:
    """Run the whole pipeline on the shipped dataset and print where the report is."""
    from tracesynth.evaluate.pipeline import load_config, run_pipeline
    from tracesynth.resources import dataset_dir

    if not config.is_file():
        raise TraceSynthError("demo config not found", config)
    cfg = load_config(config)
    if not cfg.get("traces"):
        cfg["data"]["dir"] = str(dataset_dir(data).resolve())
    report = run_pipeline(cfg, out, console=console)
    console.print(f"[bold]tracesynth report:[/] {report}")
