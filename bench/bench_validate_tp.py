"""A TP=2 rank's forward-latency prediction against the real TP=2 vLLM replica on this CPU (issue 47, item 4).

For each model: rank 0's predictor (``dooly profile --tp 2``'s profile: the rank's shards, its collectives timed
between two processes, the one-device framework overhead) is scored against the replica's real forwards at the
held-out validation shapes: two processes, one per core, each vLLM's model for its rank (dummy weights), the
all-reduces through vLLM's shared-memory communicator, the ranks lined up before each forward, rank 0's wall
time (``dooly validate --engine vllm --tp 2``; :func:`dooly.predict.validate_parallel.validate_parallel`).
Every shape is measured in ``--rounds`` interleaved rounds; their spread is the noise floor, printed beside each
MAPE with the ratio (the target: MAPE at most 2x the noise floor). Figures only, no assertions.

The zoo models are profiled into the DB first (one-device profile with calibration, then the TP=2 rank's; a DB
that already holds them is reused, only what it lacks is timed). The never-profiled model (``--unprofiled``,
default bench/configs/qwen2-768.json: 12 heads, 2 KV heads) is predicted from the others' profiles with the
shape model (``--shape``). Run it on an otherwise idle machine (the load average is printed first):

    .venv/bin/python bench/bench_validate_tp.py [--db out/bench-tp/profiles.db] [--grid default|tiny]

The validation itself is short (qwen2.5-0.5b at TP=2 in bf16: a 200-token prefill ~0.4 s, the ranks' start
~25 s; the longest step is filling the cache of decode 12 x 700, an 8,400-token prefill per round); a first run
spends most of its time profiling, a run on the same DB only validates. ``--shapes N`` keeps the first N held-out
shapes of each phase.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

MODELS = ("opt-125m", "qwen2.5-0.5b")  # zoo models whose heads (12; 14 and 2 KV) divide by 2
UNPROFILED = (str(Path(__file__).parent / "configs" / "qwen2-768.json"),)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", type=Path, default=Path("out/bench-tp/profiles.db"))
    ap.add_argument("--models", nargs="*", default=list(MODELS), help="profiled (one device, then TP=2) and scored")
    ap.add_argument("--unprofiled", nargs="*", default=list(UNPROFILED), help="never profiled, predicted from shape")
    ap.add_argument("--grid", default="default",
                    help="profiling grid: default, or tiny (a smoke run: too few points to extrapolate)")  # fmt: skip
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per shape (their spread: noise floor)")
    ap.add_argument("--repeats", type=int, default=3, help="timed forwards per shape and round (median)")
    ap.add_argument("--shapes", type=int, help="only the first N held-out shapes of each phase (default: all)")
    ap.add_argument("--dtype", help="default: bfloat16 where the CPU has AVX-512 BF16 or AMX, else float32")
    args = ap.parse_args()

    from dooly.serve.vllm_serving import cpu_serving_dtype, vllm_available

    why = vllm_available()
    if why:
        print(f"skipped: {why}")
        return
    from dooly.api import ProfileHooks, load_latency_model, profile_models
    from dooly.core.errors import DoolyError
    from dooly.core.zoo import resolve_model
    from dooly.engines import get_engine
    from dooly.predict.validate import VALIDATION_SHAPES, phase_mape, round_spread
    from dooly.predict.validate_parallel import validate_parallel

    dtype = args.dtype or cpu_serving_dtype()
    shapes = {ph: vs[: args.shapes] for ph, vs in VALIDATION_SHAPES.items()}
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores"
          + ("  (busy: the figures below are not trustworthy)" if load[0] > 1.0 else ""))  # fmt: skip
    listed = "; ".join(f"{ph} " + ", ".join("x".join(map(str, v.values())) for v in vs) for ph, vs in shapes.items())
    print(f"TP={args.tp}, {dtype}, 1 thread per rank, grid {args.grid}, {args.rounds} rounds x {args.repeats} "
          f"forwards per shape; shapes: {listed}")  # fmt: skip
    args.db.parent.mkdir(parents=True, exist_ok=True)
    hooks = ProfileHooks(log=lambda m: None, report=lambda m: None)
    for model in args.models:
        for tp in (1, args.tp):  # the one-device profile calibrates the overhead a rank's predictor takes
            t0 = time.perf_counter()
            run = profile_models([model], args.db, engine="vllm", dtype=dtype, threads=1, grid=args.grid, tp=tp,
                                 hooks=hooks)  # fmt: skip
            print(f"profiled {model} at TP={tp}: {len(run.plan.jobs)} jobs, {run.plan.todo_points} points, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    engine = get_engine("vllm", dtype=dtype, tp=args.tp)
    print(f"{'model':16s} {'ops':14s} {'MAPE pre/dec/all %':>20s} {'noise pre/dec/all %':>21s} {'ratio':>6s} "
          f"{'<=2x':>5s} {'wall s':>7s} {'load':>5s}")  # fmt: skip
    for model in [*args.models, *args.unprofiled]:
        t0 = time.perf_counter()
        unprofiled = model in args.unprofiled
        name, cfg = resolve_model(model)
        try:
            pred = load_latency_model(model, args.db, dtype, 1, "vllm", shape=unprofiled, tp=args.tp)
            rows = validate_parallel(pred, cfg, engine, shapes, threads=1, repeats=args.repeats, rounds=args.rounds)
        except DoolyError as exc:
            print(f"{name:16s} failed: {exc}", flush=True)
            continue
        mape = [phase_mape(rows, ph) for ph in ("prefill", "decode", None)]
        noise = [round_spread(rows, ph) for ph in ("prefill", "decode", None)]
        ratio = mape[2] / noise[2] if noise[2] > 0 else float("inf")
        cells = f"{'/'.join(f'{x:.1f}' for x in mape):>20s} {'/'.join(f'{x:.1f}' for x in noise):>21s}"
        print(f"{name:16s} {'shape model' if unprofiled else 'profiled':14s} {cells} {ratio:6.1f} "
              f"{'yes' if ratio <= 2 else 'no':>5s} {time.perf_counter() - t0:7.0f} {os.getloadavg()[0]:5.2f}",
              flush=True)  # fmt: skip
        for r in rows:
            meas = " / ".join(f"{x * 1e3:.1f}" for x in r.rounds_s)
            print(f"    {r.phase:7s} {' '.join(f'{k}={v}' for k, v in r.values.items()):24s} measured {meas:>16s} ms"
                  f"  predicted {r.predicted_s * 1e3:8.1f} ms  error {100 * r.error:5.1f}%")  # fmt: skip
    print(
        "MAPE: rank 0's predicted forward vs the replica's measured one (median of the rounds' medians); noise: "
        "the rounds' spread at the same shapes, (max-min)/mean averaged; ratio: MAPE all / noise all; load: the "
        "1-minute load average as the model's validation ended (the ranks themselves add 2)"
    )


if __name__ == "__main__":
    main()
