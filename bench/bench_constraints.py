"""Constraint mining, checking and repair: generalisation, throughput, and what repair changes.

    .venv/bin/python bench/bench_constraints.py [--data data] [--events 3000000] [--sample-events 50000]

For each shipped workload (data/*.parquet; the shared LTTng trace when data/ is empty):

* false-positive rate: rules mined on the training block (first 80% in time, split_by_time) are
  checked against the same workload's real validation and test blocks (the issue asks <= 0.5%);
* raw samples with violations: (a) the real test block corrupted (events swapped, dropped, moved
  to random CPUs, gaps scaled), (b) an order-1 Markov chain over event types fitted on the
  training block (other columns copied from a random training row of the sampled type);
  violations before / after repair, fraction of events changed, repair events/s;

and checking throughput (events/s) on a multi-million-event trace tiled from real data.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from tracesynth.constraints import check_trace, mine_rules, repair_trace
from tracesynth.io import read_trace
from tracesynth.splits import split_by_time
from tracesynth.trace import Trace

REPO = Path(__file__).resolve().parents[1]
SHARED_LTTNG = REPO.parent / "shared" / "traces" / "lttng-wget-kernel"


def load_workloads(data: Path) -> dict[str, Trace]:
    files = sorted(data.glob("*.parquet"))
    if files:
        return {f.stem: Trace.load(f) for f in files}
    if SHARED_LTTNG.exists():
        return {"lttng-wget": read_trace(SHARED_LTTNG)}
    sys.exit(f"no traces: {data}/*.parquet is empty and {SHARED_LTTNG} is absent")


def tile(trace: Trace, n_events: int) -> Trace:
    """Repeat a trace, shifting time, until it holds at least n_events."""
    k = max(1, -(-n_events // len(trace)))
    span = trace.duration_ns + 1
    parts = [trace.with_columns(ts=trace.ts + i * span) for i in range(k)]
    return Trace.concat(parts)


def corrupt(trace: Trace, seed: int, rate: float = 0.02) -> Trace:
    """Swap event types among `rate` of events, drop `rate`, move `rate` to random CPUs, scale `rate` gaps."""
    rng = np.random.default_rng(seed)
    n = len(trace)
    ev = np.array(trace.column("event").to_pylist(), dtype=object)
    idx = rng.choice(n, int(n * rate), replace=False)
    ev[idx] = ev[rng.permutation(idx)]
    cpu = trace.numeric("cpu")
    cpus = np.unique(cpu[cpu >= 0]) if (cpu >= 0).any() else np.array([0])
    j = rng.choice(n, int(n * rate), replace=False)
    cpu[j] = rng.choice(cpus, len(j))
    cpu_arr = pa.array(cpu.astype(np.int32), mask=trace.table["cpu"].is_null().to_numpy(zero_copy_only=False))
    dt = np.diff(trace.ts)
    k = rng.choice(len(dt), int(len(dt) * rate), replace=False)
    dt[k] = (dt[k] * np.exp(rng.normal(0, 3, len(k)))).astype(np.int64)
    ts = np.concatenate([trace.ts[:1], trace.ts[0] + np.cumsum(dt)])
    t = trace.with_columns(ts=ts, event=ev.tolist(), cpu=cpu_arr)
    keep = rng.random(n) > rate
    return Trace(t.table.filter(pa.array(keep)), t.metadata)


def markov_sample(train: Trace, n: int, seed: int) -> Trace:
    """Order-1 Markov chain over event types; the other columns come from a random training row
    of the sampled type (so each column is realistic on its own, the structure is not)."""
    rng = np.random.default_rng(seed)
    codes, vocab = train.codes("event")
    V = len(vocab)
    counts = np.zeros((V, V))
    np.add.at(counts, (codes[:-1], codes[1:]), 1)
    counts[counts.sum(axis=1) == 0] = 1
    cum = np.cumsum(counts / counts.sum(axis=1, keepdims=True), axis=1)
    seq = np.empty(n, dtype=np.int64)
    seq[0] = codes[0]
    u = rng.random(n)
    for i in range(1, n):
        seq[i] = min(int(np.searchsorted(cum[seq[i - 1]], u[i], side="right")), V - 1)
    rows_of = [np.flatnonzero(codes == v) for v in range(V)]
    pick = np.array([rows_of[v][int(rng.integers(len(rows_of[v])))] for v in seq])
    dt = np.concatenate([[0], np.diff(train.ts)])[pick]
    table = train.table.take(pa.array(pick))
    table = table.set_column(0, "ts", pa.array(train.ts[0] + np.cumsum(np.maximum(dt, 0))))
    return Trace(table, train.metadata)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=REPO / "data")
    ap.add_argument("--events", type=int, default=3_000_000, help="events in the tiled throughput trace")
    ap.add_argument("--sample-events", type=int, default=20_000, help="events per Markov sample")
    ap.add_argument("--repair-events", type=int, default=30_000, help="corrupted events repaired for throughput")
    ap.add_argument("--throughput-only", action="store_true", help="skip the per-workload tables")
    args = ap.parse_args()
    out = Console(width=200)
    workloads = load_workloads(args.data)

    fp = Table("workload", "events", "train", "rules", "val FP", "test FP", "test FP by rule", title="false positives")
    rp = Table(
        "workload",
        "sample",
        "events",
        "violations",
        "violating",
        "after",
        "changed",
        "dropped",
        "repair ev/s",
        title="repair of raw samples (violations before -> after)",
    )
    worst = 0.0
    mined = {}
    for name, trace in workloads.items():
        train, val, test = split_by_time(trace)
        t0 = time.perf_counter()
        rules = mine_rules([train])
        mine_s = time.perf_counter() - t0
        mined[name] = (train, rules)
        if args.throughput_only:
            continue
        rv, rt = check_trace(val, rules), check_trace(test, rules)
        worst = max(worst, rt.rate)
        by_rule = ", ".join(f"{k} {v}" for k, v in rt.counts.items() if v)
        fp.add_row(
            name,
            f"{len(trace):,}",
            f"{len(train):,} ({mine_s:.1f} s)",
            f"{sum(rules.summary().values())}",
            f"{rv.rate:.3%}",
            f"{rt.rate:.3%}",
            by_rule,
        )
        for label, raw in (
            ("corrupted test", corrupt(test, seed=1)),
            ("markov", markov_sample(train, min(args.sample_events, len(train)), seed=2)),
        ):
            before = check_trace(raw, rules)
            t0 = time.perf_counter()
            fixed, rep = repair_trace(raw, rules, seed=0)
            rs = time.perf_counter() - t0
            after = check_trace(fixed, rules)
            rp.add_row(
                name,
                label,
                f"{len(raw):,}",
                f"{before.total:,}",
                f"{before.rate:.1%}",
                f"{after.total}",
                f"{rep.fraction_changed:.1%}",
                f"{rep.deleted:,}",
                f"{len(raw) / rs:,.0f}",
            )
    if not args.throughput_only:
        out.print(fp)
        out.print(f"worst test-block false-positive rate: {worst:.3%} (target <= 0.5%)")
        out.print(rp)

    # throughput on a tiled real trace (largest workload)
    name = max(workloads, key=lambda k: len(workloads[k]))
    train, rules = mined[name]
    big = tile(workloads[name], args.events)
    check_trace(big.slice(0, 10_000), rules)  # warm up
    best = min(_timed(lambda: check_trace(big, rules)) for _ in range(3))
    bad = tile(corrupt(workloads[name], seed=3), args.events)
    best_bad = min(_timed(lambda: check_trace(bad, rules)) for _ in range(2))
    rep_n = min(len(bad), args.repair_events)
    rep_t = _timed(lambda: repair_trace(bad.slice(0, rep_n), rules, seed=0))
    out.print(
        f"checking ({name} tiled to {len(big):,} events): {len(big) / best:,.0f} events/s clean, "
        f"{len(bad) / best_bad:,.0f} events/s on a corrupted copy ({check_trace(bad, rules).rate:.2%} violating); "
        f"repair of {rep_n:,} corrupted events: {rep_n / rep_t:,.0f} events/s"
    )


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
