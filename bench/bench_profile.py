"""Profile the zoo's small models with cross-model reuse, then validate the predictor on held-out shapes.

Prints: profiling device-seconds with vs without reuse (measured per signature) and the saving; the
predictor's held-out interpolation error (interp vs forest); iteration-latency MAPE per phase for every
profiled model and for a model that was never profiled (all its signatures come from the others).

    .venv/bin/python bench/bench_profile.py --db /tmp/dooly_bench.db          # resumable; rerun to continue
    .venv/bin/python bench/bench_profile.py --db /tmp/dooly_bench.db --zoo    # + point-count savings, whole zoo

Timing uses one torch thread and, on the CPU, the thread-CPU clock (see dooly.profiler.default_clock): on a
shared machine wall time mostly measures the other tenants.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from dooly.engines import get_engine
from dooly.predictor import Predictor, method_errors, phase_mape, round_spread, validate_model
from dooly.profiler import calibrate, default_clock, make_plan, profiled_savings, run_plan, savings
from dooly.store import ProfileStore
from dooly.zoo import resolve_model

SMALL = ["smollm2-135m", "smollm2-360m", "qwen2.5-0.5b", "opt-125m"]


def reused_only_config() -> dict:
    """A model never profiled: SmolLM2-135M's attention and vocabulary with 20 layers (every signature is
    already in the DB from smollm2-135m; its framework overhead comes from the other models' fit)."""
    _, cfg = resolve_model("smollm2-135m")
    cfg = dict(cfg)
    cfg["num_hidden_layers"] = 20
    cfg["_name_or_path"] = "smollm2-135m-20l (never profiled)"
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="/tmp/dooly_bench.db")
    ap.add_argument("--models", nargs="+", default=SMALL)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--zoo", action="store_true", help="also plan the whole zoo (point-count savings estimate)")
    ap.add_argument("--skip-validate", action="store_true")
    ap.add_argument("--repeats", type=int, default=7, help="timed forwards per held-out shape (median)")
    ap.add_argument("--validate", nargs="*", default=None, help="validate only these models (default: all)")
    ap.add_argument("--no-reused", action="store_true", help="skip the never-profiled model's validation")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = get_engine()
    print(f"clock: {default_clock('cpu', args.threads)}; threads {args.threads}; db {args.db}")

    with ProfileStore(args.db) as store:
        t0 = time.perf_counter()
        plan = make_plan(args.models, store, engine, threads=args.threads, progress=print)
        print(f"traced/planned in {time.perf_counter() - t0:.1f} s: {len(plan.grid_size)} unique signatures, "
              f"{len(plan.known)} already in the DB, {plan.todo_points} points to time")  # fmt: skip
        stats = run_plan(plan, store, engine, threads=args.threads)
        print(f"profiled: {stats}")
        calib = 0.0
        for m in args.models:
            name, cfg = resolve_model(m)
            calib += calibrate(name, cfg, store, engine, plan.ctx, threads=args.threads)
        print(f"calibration forwards this run: {calib:.1f} s")
        sv = savings(plan, store)
        for r in sv.models:
            print(f"  {r.name:16s} sigs {r.signatures:4d} new {r.new:4d} reused(list) {r.reused_models:4d} "
                  f"alone {r.alone_s:7.1f} s  with reuse {r.marginal_s:7.1f} s")  # fmt: skip
        print(f"PROFILING COST ({', '.join(args.models)}): {sv.describe()}")
        for ctx, db_sv in profiled_savings(store).items():  # what `dooly report` headlines for this DB
            if ctx == plan.ctx:
                print(f"PROFILING COST (every model profiled into {args.db}): {db_sv.describe()}")
        raw = store.all_points(plan.ctx)
        pts = {k: [(p, m.median_s) for p, m in v] for k, v in raw.items()}
        errs = method_errors(pts, sample=60)
        print(f"HELD-OUT GRID-LINE MAPE: interp {100 * np.mean(errs['interp']):.1f}%  "
              f"forest {100 * np.mean(errs['forest']):.1f}%  (n={len(errs['interp'])})")  # fmt: skip

    if not args.skip_validate:
        results = {}
        chosen = args.models if args.validate is None else args.validate
        targets = [(m, resolve_model(m)[1]) for m in chosen]
        if not args.no_reused:
            targets.append((None, reused_only_config()))
        for m, cfg in targets:
            name = m or cfg["_name_or_path"]
            pred = Predictor.for_model(m or cfg, args.db, engine, threads=args.threads)
            with ProfileStore(args.db) as store:  # held-out measurements are kept: a rerun re-scores them
                rows = validate_model(pred, cfg, engine, threads=args.threads, repeats=args.repeats, store=store)
            results[name] = {ph: phase_mape(rows, ph) for ph in ("prefill", "decode")}
            for r in rows:
                rounds = "/".join(f"{x * 1e3:.1f}" for x in r.rounds_s)
                print(f"  {name:16s} {r.phase:7s} {json.dumps(r.values):32s} measured {r.measured_s * 1e3:8.2f} ms "
                      f"(rounds {rounds})  predicted {r.predicted_s * 1e3:8.2f} ms  err {r.error * 100:5.1f}%",
                      flush=True)  # fmt: skip
            print(f"VALIDATION {name}: MAPE prefill {results[name]['prefill']:.1f}%  "
                  f"decode {results[name]['decode']:.1f}%  (method {pred.method}); run-to-run spread of the "
                  f"measurements prefill {round_spread(rows, 'prefill'):.1f}%  "
                  f"decode {round_spread(rows, 'decode'):.1f}%",
                  flush=True)  # fmt: skip

    if args.zoo:
        from dooly.zoo import list_models

        with ProfileStore(args.db) as store:
            names = [m.name for m in list_models()]
            zplan = make_plan(names, store, engine, threads=args.threads, progress=print)
            # cost by grid points (measured where profiled, mean per-point cost elsewhere)
            sv = savings(zplan, store)
            print(f"ZOO: {sv.describe()}")


if __name__ == "__main__":
    Path("/tmp").mkdir(exist_ok=True)
    main()
