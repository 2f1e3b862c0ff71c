"""`dooly demo`: the whole dooly pipeline on the zoo's small models, in a few minutes on a CPU.

1. trace + profile two small models into one DB (``dooly profile``; the second reuses the first's profiles and
   is only checked against the first's calibration, and calibrated at its own depth if the check misses),
2. validate serving: the real engine serves a small Poisson workload and the simulator predicts it,
3. simulate a larger workload at a load that queues and sweep engine settings under an SLO,
4. write the HTML report.

Each step is the public CLI command, run as a subprocess, so the demo exercises exactly what a user runs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from dooly.core.errors import DoolyError
from dooly.engines._reaper import die_with_parent

SMALL_MODELS = ("smollm2-135m", "smollm2-360m")
VALIDATE_MODEL = "smollm2-135m"
VALIDATE_WORKLOAD = "poisson:n=24,rate=4,prompt=16-128,output=8-24,seed=0"
SIM_REQUESTS = "n=200,prompt=32-256,output=8-64,seed=1"  # the sweep's requests (their rate: queueing_rate)
SWEEP_SLO = ("5.0", "0.5")  # p90 TTFT and TPOT, seconds


def queueing_rate(db: Path, model: str, max_num_seqs: int = 16) -> float:
    """An arrival rate at which the sweep's configurations differ: the simulated capacity (requests/s) of a
    mid-sized configuration on the sweep's requests. Below it nothing queues and every row of the sweep is
    the same; at it the small ``max_num_seqs`` queue (TTFT grows) and the large ones batch more (TPOT
    grows), so the SLO picks among them. Taken from the profiles, since the machine sets the capacity."""
    from dooly.api import load_latency_model
    from dooly.simulator import SchedulerConfig, parse_workload, simulate

    burst = parse_workload(f"static:{SIM_REQUESTS}")
    res = simulate(burst, load_latency_model(model, db), SchedulerConfig(max_num_seqs=max_num_seqs))
    return float(f"{res.summary.throughput_requests:.2g}")


def _run(args: list[str], console: Console) -> None:
    console.print(f"[bold]$ dooly {' '.join(args)}[/]")
    # a demo killed (even by SIGKILL) takes its step with it; the step's own servers die with the step
    proc = subprocess.run([sys.executable, "-m", "dooly", *args], preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    if proc.returncode != 0:
        raise DoolyError(f"demo step `dooly {' '.join(args)}` failed (exit {proc.returncode})")


def run_demo(workdir: str | Path, quick: bool = False, grid: str = "default") -> Path:
    """Run every step into `workdir`; returns the report path. `grid` is the profiler's request-value grid
    (``default`` is accurate; ``tiny`` is faster and much less accurate)."""
    console = Console(stderr=True)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    db = workdir / "profiles.db"
    models = SMALL_MODELS[:1] if quick else SMALL_MODELS
    # one grid for every model: the predictor fits the framework overhead jointly over the DB's models, so a
    # coarsely profiled neighbour would skew the validated model's prediction. --calibrate check: the first model
    # (the one validated) is calibrated in full, the second only checked against it
    profile = ["profile", *models, "--db", str(db), "--grid", "tiny" if quick else grid, "--calibrate", "check"]
    _run(profile, console)
    workload = "poisson:n=8,rate=4,prompt=16-64,output=4-8,seed=0" if quick else VALIDATE_WORKLOAD
    _run(["validate-serving", VALIDATE_MODEL, "--db", str(db), "--workload", workload], console)
    rate = queueing_rate(db, VALIDATE_MODEL)
    console.print(f"sweep load: {rate:g} requests/s, the simulated capacity at max_num_seqs=16")
    _run(
        [
            "simulate",
            VALIDATE_MODEL,
            "--db",
            str(db),
            "--workload",
            f"poisson:rate={rate:g},{SIM_REQUESTS}",
            "--sweep",
            "--slo-ttft",
            SWEEP_SLO[0],
            "--slo-tpot",
            SWEEP_SLO[1],
            "-o",
            str(workdir / "sweep.csv"),
        ],
        console,
    )
    _run(["export-vidur", VALIDATE_MODEL, "--db", str(db), "-o", str(workdir / "vidur" / VALIDATE_MODEL)], console)
    report = workdir / "dooly-report.html"
    _run(["report", "--db", str(db), "-o", str(report)], console)
    return report
