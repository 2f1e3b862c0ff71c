"""`tracesynth demo`: the main job on the data the project ships.

Runs the whole pipeline (sample the shipped autoregressive checkpoint models/all, train the diffusion
model and the Markov baseline, sample, repair, evaluate, report) on the shipped dataset under data/, as
configured by the shipped configs/demo.json. The demo's slices are from the last 30% of each trace,
which the checkpoint never saw; `--retrain SECONDS` fits that model on each demo training block instead.
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
    retrain: float = typer.Option(
        0.0, "--retrain", metavar="SECONDS",
        help="Train the shipped checkpoint's model afresh on each workload's demo training block for this "
        "many seconds instead of sampling the checkpoint (0: sample the checkpoint).",
    ),
) -> None:
    """Run the whole pipeline on the shipped dataset and print where the report is."""
    from tracesynth.evaluate.pipeline import load_config, resolve_path, run_pipeline
    from tracesynth.resources import dataset_dir

    if not config.is_file():
        raise TraceSynthError("demo config not found", config)
    cfg = load_config(config)
    if not cfg.get("traces"):
        cfg["data"]["dir"] = str(dataset_dir(data).resolve())
    for spec in cfg["generators"].values():
        if spec.get("load") and retrain > 0:
            spec["config"] = _retrain_config(cfg, spec.pop("load"), retrain)
        elif spec.get("load") and not resolve_path(spec["load"], cfg["_base"]).is_dir():
            raise TraceSynthError("the shipped checkpoint is not here (it ships with the repository, not the wheel): "
                                  "run the demo from a checkout, or give --retrain SECONDS to train it",
                                  Path(spec["load"]))
    report = run_pipeline(cfg, out, console=console)
    console.print(f"[bold]tracesynth report:[/] {report}")


def _retrain_config(cfg: dict, load: str, seconds: float) -> dict:
    """The saved model's config, to be fitted per workload for `seconds` (not conditional)."""
    import json

    from tracesynth.evaluate.pipeline import resolve_path

    path = resolve_path(load, cfg["_base"]) / "config.json"
    try:
        saved = json.loads(path.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TraceSynthError(f"cannot read the model config to retrain ({exc})", path) from None
    return {**saved, "conditional": False, "steps": 10**9, "time_limit": seconds}
