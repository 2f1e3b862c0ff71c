"""`dooly demo`: the whole dooly pipeline on the zoo's small models, in a few minutes on a CPU.

1. trace + profile the small models into one DB (``dooly profile``; later models reuse earlier profiles):
   the model whose serving is validated on the profiler's default grid (accuracy), the others on the tiny
   grid (minutes), so the demo shows both a validation and cross-model reuse on two shared cores,
2. validate serving: the real engine serves a small Poisson workload and the simulator predicts it,
3. simulate a larger workload and sweep engine settings under an SLO,
4. write the HTML report.

Each step is the public CLI command, run as a subprocess, so the demo exercises exactly what a user runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rich.console import Console

from dooly.errors import DoolyError

SMALL_MODELS = ("smollm2-135m", "qwen2.5-0.5b", "smollm2-360m")
VALIDATE_MODEL = "smollm2-135m"
VALIDATE_WORKLOAD = "poisson:n=24,rate=4,prompt=16-128,output=8-24,seed=0"
SIM_WORKLOAD = "poisson:n=200,rate=0.3,prompt=32-256,output=8-64,seed=1"  # below capacity on 2 CPU cores


def _run(args: list[str], console: Console) -> None:
    console.print(f"[bold]$ dooly {' '.join(args)}[/]")
    proc = subprocess.run([sys.executable, "-m", "dooly", *args])
    if proc.returncode != 0:
        raise DoolyError(f"demo step `dooly {' '.join(args)}` failed (exit {proc.returncode})")


def run_demo(workdir: str | Path, quick: bool = False, grid: str = "default") -> Path:
    """Run every step into `workdir`; returns the report path. `grid` is the profiler's request-value grid
    for the validated model (``default`` is accurate; ``tiny`` is faster and much less accurate)."""
    console = Console(stderr=True)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    db = workdir / "profiles.db"
    others = [m for m in (SMALL_MODELS[:2] if quick else SMALL_MODELS) if m != VALIDATE_MODEL]
    _run(["profile", VALIDATE_MODEL, "--db", str(db), "--grid", "tiny" if quick else grid], console)
    _run(["profile", *others, "--db", str(db), "--grid", "tiny"], console)
    workload = "poisson:n=8,rate=4,prompt=16-64,output=4-8,seed=0" if quick else VALIDATE_WORKLOAD
    _run(["validate-serving", VALIDATE_MODEL, "--db", str(db), "--workload", workload], console)
    _run(
        ["simulate", VALIDATE_MODEL, "--db", str(db), "--workload", SIM_WORKLOAD, "--sweep",
         "--slo-ttft", "5.0", "--slo-tpot", "0.5", "-o", str(workdir / "sweep.csv")],
        console,
    )  # fmt: skip
    _run(["export-vidur", VALIDATE_MODEL, "--db", str(db), "-o", str(workdir / "vidur" / VALIDATE_MODEL)], console)
    report = workdir / "dooly-report.html"
    _run(["report", "--db", str(db), "-o", str(report)], console)
    return report
