"""Re-score a `dooly validate` log's measured forwards with today's predictor, without measuring again.

`dooly validate` prints each held-out shape's measured latency; a validation run without `--keep` stored
nothing else. This reads those rows back from the log and prices the same shapes with the predictor of the
code checked out now, on a profile DB, so a predictor change is judged on the very measurements it missed:

    .venv/bin/python bench/rescore_validation.py results/zoo-cpu/llama-3.1-8b-from-3b-shape.log \\
        --model llama-3.1-8b --db l3.db --shape

(`l3.db`: the DB the log was predicted from, here `dooly profile llama-3.2-3b --db l3.db`.) The measurements
were taken on the machine that wrote the log; the DB must be profiled on the same kind of machine.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

ROW = re.compile(r"│ (prefill|decode|chunk)\s+│ ((?:\w+=\d+ ?)+)\s+│\s+([\d.]+) │")


def measured_rows(log: str) -> list[tuple[str, dict[str, int], float]]:
    """(phase, request values, measured seconds) of each table row of a `dooly validate` log."""
    rows = []
    for m in ROW.finditer(log):
        values = {k: int(v) for k, v in (kv.split("=") for kv in m.group(2).split())}
        rows.append((m.group(1), values, float(m.group(3)) / 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path, help="a `dooly validate` log (its table as printed)")
    ap.add_argument("--model", required=True, help="the model the log validated (zoo name or config path)")
    ap.add_argument("--db", type=Path, required=True)
    ap.add_argument("--shape", action="store_true", help="as `dooly validate --shape`")
    ap.add_argument("--method", default="interp", help="interp or forest (the log's header says which it used)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    from dooly.core.errors import DoolyError
    from dooly.engines import get_engine
    from dooly.predict.predictor import Predictor
    from dooly.predict.validate import ValidationRow, phase_mape

    rows = measured_rows(args.log.read_text())
    if not rows:
        sys.exit(f"{args.log}: no table rows of `dooly validate` found")
    engine = get_engine("hf-eager", device="cpu", dtype=args.dtype)
    try:
        pred = Predictor.for_model(args.model, args.db, engine, threads=args.threads, method=args.method,
                                   shape=args.shape)  # fmt: skip
    except DoolyError as exc:
        sys.exit(str(exc))
    scored = [ValidationRow(phase, values, measured, pred.forward_latency(phase, values))
              for phase, values, measured in rows]  # fmt: skip
    for r in scored:
        shape = " ".join(f"{k}={v}" for k, v in r.values.items())
        from_shape = ""
        if args.shape:  # as `dooly validate`'s "from shape % (±)" column
            share, unc = pred.shape_share(r.phase, r.values)
            from_shape = f"  from shape {100 * share:.0f}% (±{100 * unc:.0f}%)"
        print(f"{r.phase:8s} {shape:24s} measured {r.measured_s * 1e3:9.1f} ms  "
              f"predicted {r.predicted_s * 1e3:9.1f} ms  {100 * (r.predicted_s - r.measured_s) / r.measured_s:+6.1f}%"
              + from_shape)
    phases = dict.fromkeys(r.phase for r in scored)
    print("MAPE " + "  ".join(f"{ph} {phase_mape(scored, ph):.1f}%" for ph in phases))


if __name__ == "__main__":
    main()
