"""vLLM's mixed steps in-process: a real flattened batch (decodes + a prefill chunk) timed on vLLM's model
against the predictor's ``iteration_latency``, the figure the serving simulator adds up.

A served step that holds a prefill chunk is priced from passes that were profiled alone (a prefill of all the
step's tokens plus what the decodes' KV adds); this measures such steps directly, in two interleaved rounds
(their spread is the noise floor beside each figure). Figures only, no assertions.

    .venv/bin/python bench/bench_vllm_steps.py [--db out/bench-vllm/profiles.db] [--models smollm2-135m]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

#: (decode KV lengths, prefill chunks as (new, cached) tokens): steps the serving bench's scheduler makes
#: (max_num_seqs 4, a 256-token budget): prefill alone, chunks beside 1-3 decodes, a later chunk of a prompt
STEPS = (
    ((), ((96, 0),)),
    ((), ((252, 0),)),
    ((100,), ((64, 0),)),
    ((100,), ((255, 0),)),
    ((60, 120, 180), ((32, 0),)),
    ((60, 120, 180), ((128, 0),)),
    ((60, 120, 180), ((253, 0),)),
    ((200, 200, 200), ((128, 128),)),
    ((60, 120, 180), ()),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", type=Path, default=Path("out/bench-vllm/profiles.db"))
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--dtype", help="engine dtype (default: as bench_vllm_serving picks)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from dooly.serve.vllm_serving import cpu_serving_dtype, vllm_available

    why = vllm_available()
    if why:
        print(f"skipped: {why}")
        return
    if not args.db.exists():
        sys.exit(f"{args.db}: no profile DB (bench/bench_vllm_serving.py profiles one)")
    from dooly.api import serving_latency_model
    from dooly.core.batch import Batch
    from dooly.core.zoo import resolve_model
    from dooly.engines import get_engine
    from dooly.profile import fixed_threads, measure_prepared

    dtype = args.dtype or cpu_serving_dtype()
    engine = get_engine("vllm", dtype=dtype)
    for name in args.models:
        pred, profiled_with = serving_latency_model(name, args.db, dtype, 1, "vllm")
        with fixed_threads(1):
            model = engine.build_model(resolve_model(name)[1])
            batches = [Batch(prefill=p, decode=d) for d, p in STEPS]
            inputs = [engine.prepare_batch(model, b) for b in batches]
            rounds = np.array([[measure_prepared(engine, model, x, args.repeats).median_s for x in inputs]
                               for _ in range(args.rounds)])  # fmt: skip
        print(f"{name} ({dtype}, 1 thread, ops profiled with {profiled_with}): measured vs predicted step, ms")
        print(f"{'decode KV':>14s} {'prefill (new, cached)':>22s} {'measured':>9s} {'rounds':>13s} {'predicted':>9s} "
              f"{'err %':>6s}")  # fmt: skip
        errs, spread = [], []
        for b, r in zip(batches, rounds.T, strict=True):
            meas, got = float(np.median(r)), pred.iteration_latency(b)
            errs.append(100 * (got - meas) / meas)
            spread.append(100 * (r.max() - r.min()) / r.mean())
            print(f"{','.join(map(str, b.decode)) or '-':>14s} {str(list(b.prefill)) if b.prefill else '-':>22s} "
                  f"{meas * 1e3:9.2f} {' / '.join(f'{x * 1e3:.1f}' for x in r):>13s} {got * 1e3:9.2f} "
                  f"{errs[-1]:+6.1f}")  # fmt: skip
        mixed = [e for (d, p), e in zip(STEPS, errs, strict=True) if d and p]
        print(f"MAPE all {np.mean(np.abs(errs)):.1f}%, mixed steps {np.mean(np.abs(mixed)):.1f}% (signed mean "
              f"{np.mean(mixed):+.1f}%); rounds spread {np.mean(spread):.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()
