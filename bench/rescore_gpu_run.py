"""Re-score a GPU run of `bench/cuda_check.sh` with the predictor in this tree, on any machine (no GPU needed).

    python bench/rescore_gpu_run.py results/cuda-h200

A lent GPU machine is gone once its run ends; what it measured stays in the run's folder: the profile DB
(`profiles.db`: operator points and calibration forwards), the held-out forwards `dooly validate` measured
(`validate.log`) and the served workload with each request's measured TTFT/TPOT (`serving.json`). This prints,
for the predictor as it is now: forward-latency MAPE per phase on those held-out forwards, and the simulated
TTFT/TPOT of the served workload, each beside what the run itself printed.

It reads the model's traces that the GPU run cached in its DB. They are keyed by a digest of the tracing code
(`dooly.profile.traces.tracer_version`: tracer, taint, signature, engines), so once that code changes they
are stale, and tracing anew needs the GPU: rerun `bench/cuda_check.sh` on one.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from dooly.api import sched_config  # noqa: E402
from dooly.core.errors import DoolyError  # noqa: E402
from dooly.engines import get_engine  # noqa: E402
from dooly.predict.predictor import Predictor  # noqa: E402
from dooly.profile import timing  # noqa: E402
from dooly.simulator import CachedLatency, parse_workload, simulate  # noqa: E402


def held_out_forwards(log: Path) -> list[tuple[str, dict[str, int], float]]:
    """(phase, request values, measured seconds) of each row of `dooly validate`'s table."""
    rows = []
    for line in log.read_text().splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) >= 3 and cells[0] in ("prefill", "decode"):
            values = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", cells[1])}
            rows.append((cells[0], values, float(cells[2]) / 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, nargs="?", default=REPO / "results" / "cuda-h200",
                    help="folder of a cuda_check.sh run (profiles.db, validate.log, serving.json)")
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    db = args.run / "profiles.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        hw = [h for (h,) in con.execute("SELECT DISTINCT hardware FROM points") if h.startswith("cuda:")]
    if len(hw) != 1:
        sys.exit(f"{db}: expected the points of one GPU, found {hw or 'none'}")
    # the predictor keys profiles by the hardware it runs on; here it must read the GPU's, named as stored
    gpu = hw[0].removesuffix(f":{timing.TIMING_METHOD}")
    timing.hardware_fingerprint = lambda device, threads=None: gpu
    engine = get_engine(device="cpu")
    engine.device = "cuda"  # context and clock of the GPU run; nothing is executed
    try:
        pred = Predictor.for_model(args.model, db, engine, threads=1)
    except DoolyError as exc:  # skipped as the other benches skip what this machine cannot run (`make bench`)
        print(f"skipped: {db}: cannot predict {args.model} from the GPU run's traces (stale once the tracing code "
              f"changes; rerun bench/cuda_check.sh on a GPU): {exc}")
        return
    print(f"{args.model} on {gpu}: overhead {'max(kernels, host)' if pred.overhead.overlapped else 'kernels + host'}")

    rows = held_out_forwards(args.run / "validate.log")
    err: dict[str, list[float]] = {"prefill": [], "decode": []}
    for phase, values, measured in rows:
        err[phase].append(abs(pred.forward_latency(phase, values) - measured) / measured * 100)
    printed = [ln for ln in (args.run / "validate.log").read_text().splitlines() if ln.startswith("MAPE")]
    print(f"held-out forwards ({len(rows)}): MAPE prefill {np.mean(err['prefill']):.1f}%  decode "
          f"{np.mean(err['decode']):.1f}%  all {np.mean(err['prefill'] + err['decode']):.1f}%"
          f"   (the run printed: {printed[0] if printed else '-'})")

    served = json.loads((args.run / "serving.json").read_text())
    seqs, tokens = (int(x) for x in re.findall(r"(?:seqs|tokens)=(\d+)", served["config"])[:2])
    sim = simulate(parse_workload(served["workload"]), CachedLatency(pred),
                   sched_config(seqs, tokens, "chunked" in served["config"], 16, 4096))
    for k in ("ttft", "tpot"):
        m = np.array([np.nan if x is None else x for x in served["measured"][k]], float)
        s = np.asarray(getattr(sim.metrics, k), float)
        ok = np.isfinite(m) & np.isfinite(s) & (m > 0)
        then = np.array([np.nan if x is None else x for x in served["simulated"][k]], float)
        print(f"serving {k.upper()}: measured p50 {np.nanmedian(m) * 1e3:.1f} ms, simulated p50 "
              f"{np.nanmedian(s) * 1e3:.1f} ms (the run: {np.nanmedian(then) * 1e3:.1f}), per-request MAPE "
              f"{100 * np.mean(np.abs(s[ok] - m[ok]) / m[ok]):.1f}% (the run: "
              f"{100 * np.mean(np.abs(then[ok] - m[ok]) / m[ok]):.1f}%)")
    spread = served["run_to_run_pct"]
    print("run-to-run spread of the two real runs: " + ", ".join(f"{k} {v:.1f}%" for k, v in spread.items()))


if __name__ == "__main__":
    main()
