"""`tracesynth evaluate | report | run | experiment`: score synthetic traces, render the report, run pipelines."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tracesynth.cli.app import app, console
from tracesynth.errors import TraceSynthError
from tracesynth.resources import configs_dir

CONFIGS = configs_dir()


@app.command()
def evaluate(
    real: Path = typer.Argument(..., help="Real trace (the data the generator learned from, any readable format)."),
    synthetic: Path = typer.Argument(..., help="Synthetic trace to score."),
    rules: Path = typer.Option(None, "--rules", help="Rules JSON (tracesynth mine) for the violation rate."),
    window: int = typer.Option(128, "--window", help="Window length for the copied-window share."),
) -> None:
    """Fidelity and privacy metrics of a synthetic trace against a real one (JSD, dt/latency distances,
    violation rate, memorisation)."""
    from tracesynth.constraints import Rules
    from tracesynth.evaluate import metrics
    from tracesynth.io import read_trace
    from tracesynth.tables import cell

    r = read_trace(real)
    if not len(r):
        raise TraceSynthError("the real trace has no events: nothing to score a synthetic trace against", real)
    s = read_trace(synthetic)
    rows = metrics.fidelity(r, s)
    if rules is not None:
        rows["violation_rate"] = metrics.violation_rate(s, Rules.load(rules))
    rows.update(metrics.memorisation(s, r, window))
    table = Table("metric", "value", box=None, pad_edge=False)
    for k, v in rows.items():
        table.add_row(k, cell(v))
    Console().print(table)


@app.command()
def report(
    results: Path = typer.Argument(..., help="A pipeline output directory (or its results.json)."),
    output: Path = typer.Option(Path("report.html"), "-o", "--output", help="HTML file to write."),
) -> None:
    """Render one self-contained HTML report (plots embedded) from a pipeline's results."""
    from tracesynth.report import load_results, write_report

    write_report(load_results(results), output)
    console.print(f"report: {output}")


@app.command()
def run(
    config: Path = typer.Argument(..., help="Pipeline config (JSON or TOML); see configs/demo.json."),
    out: Path = typer.Option(Path("out/run"), "-o", "--out", help="Output directory (replaced on success)."),
) -> None:
    """Run the whole pipeline on the traces a config names: train, sample, repair, evaluate, report."""
    from tracesynth.evaluate.pipeline import run_pipeline

    path = run_pipeline(config, out, console=console)
    console.print(f"[bold]report:[/] {path}")


def experiment_names() -> list[str]:
    return sorted(p.stem.removeprefix("experiment-") for p in CONFIGS.glob("experiment-*.json"))


@app.command()
def experiment(
    name: str = typer.Argument(..., help="Experiment: " + ", ".join(experiment_names()) + "."),
    out: Path = typer.Option(None, "-o", "--out", help="Output directory (default out/experiment-NAME)."),
) -> None:
    """Run one of the paper's experiments (configs/experiment-NAME.json); tables go to CSV and Markdown."""
    from tracesynth.evaluate.pipeline import run_pipeline

    cfg = CONFIGS / f"experiment-{name}.json"
    if not cfg.is_file():
        raise TraceSynthError(f"unknown experiment {name!r} (choose from {', '.join(experiment_names())})")
    path = run_pipeline(cfg, out or Path("out") / f"experiment-{name}", console=console)
    console.print(f"[bold]report:[/] {path}; tables: {path.parent / 'results.md'}")
