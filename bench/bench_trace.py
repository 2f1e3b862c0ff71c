"""Benchmark: trace every zoo model (prefill + decode), then print times, op counts, unique signatures and the
cross-model overlap matrix (share of the row model's unique signatures that the column model also has).

    .venv/bin/python bench/bench_trace.py                   # whole zoo
    .venv/bin/python bench/bench_trace.py smollm2-135m opt-125m --phases prefill
    .venv/bin/python bench/bench_trace.py --save /tmp/traces   # also write each trace as JSON
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dooly.core.zoo import list_models, load_config
from dooly.trace.signature import ModelTrace
from dooly.trace.tracer import overlap_matrix, trace_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="zoo names or config paths (default: the whole zoo)")
    ap.add_argument("--phases", default="prefill,decode")
    ap.add_argument("--save", type=Path, help="directory to write MODEL.PHASE.json traces into")
    ap.add_argument("--load", type=Path, help="skip tracing: read MODEL.PHASE.json traces from this directory")
    a = ap.parse_args()
    console = Console(width=250)  # the overlap matrix is wide
    models = [load_config(m) for m in a.models] if a.models else list_models()
    phases = a.phases.split(",")
    per_model: dict[str, list[ModelTrace]] = {}
    table = Table(title="dooly trace: per model and phase")
    for col in (
        "model",
        "family",
        "params (B)",
        "phase",
        "ops",
        "kernels",
        "unique sigs",
        "trace s",
        "cpu s",
        "build s",
    ):
        table.add_column(col, justify="right" if col not in ("model", "family", "phase") else "left")
    if a.load:
        for m in models:
            for ph in phases:
                f = a.load / f"{m.name}.{ph}.json"
                if f.exists():
                    per_model.setdefault(m.name, []).append(ModelTrace.from_json(f.read_text(), str(f)))
    else:
        # warm the imports once so the first model's time is comparable with the others
        t0 = time.perf_counter()
        trace_model(load_config("smollm2-135m").config | {"num_hidden_layers": 1}, "prefill")
        console.print(f"warm-up (imports + one 1-layer trace): {time.perf_counter() - t0:.1f} s")
    for m in models if not a.load else []:
        for ph in phases:
            c0 = time.process_time()
            t = trace_model(m.config, ph, name=m.name)
            cpu = time.process_time() - c0  # wall time is inflated when the machine is shared; CPU time is not
            per_model.setdefault(m.name, []).append(t)
            if a.save:
                a.save.mkdir(parents=True, exist_ok=True)
                (a.save / f"{m.name}.{ph}.json").write_text(t.to_json())
            p = t.meta["parameters"] / 1e9
            counts = (str(len(t.records)), str(len(t.kernels())), str(len(t.unique())))
            secs = (f"{t.meta['seconds']:.1f}", f"{cpu:.1f}", f"{t.meta['build_seconds']:.1f}")
            row = (m.name, m.family, f"{p:.2f}", ph, *counts, *secs)
            table.add_row(*row)
            console.print("  ".join(row), highlight=False)
    console.print(table)

    # overlap over each model's union of phases
    names = list(per_model)
    merged = []
    for n in names:
        recs = [r for t in per_model[n] for r in t.records]
        first = per_model[n][0]
        merged.append(ModelTrace(n, first.config_hash, "+".join(phases), first.engine, recs))
    mat = overlap_matrix(merged)
    ov = Table(title="overlap: % of ROW model's unique signatures that COLUMN model also has")
    ov.add_column("model \\ has")
    for j, _ in enumerate(names):
        ov.add_column(str(j), justify="right")
    ov.add_column("any other", justify="right")
    sets = [set(t.unique()) for t in merged]
    for i, n in enumerate(names):
        others = set().union(*(s for k, s in enumerate(sets) if k != i)) if len(sets) > 1 else set()
        any_other = len(sets[i] & others) / len(sets[i]) if sets[i] else 0.0
        ov.add_row(f"{i} {n} ({len(sets[i])})", *(f"{100 * x:.0f}" for x in mat[i]), f"{100 * any_other:.0f}")
    console.print(ov)
    total = len(set().union(*sets)) if sets else 0
    console.print(f"unique signatures over all models: {total}; sum of per-model unique: {sum(map(len, sets))}")
    console.print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
