"""Throughput of the evaluation side: Markov fit/sample, fidelity metrics, memorisation, classifier steps.

Prints figures (events/s, ms/step) on one shipped trace; no assertions (speed is not a test).
    .venv/bin/python bench/bench_eval.py [data/scimark2.parquet]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from tracesynth.evaluate import metrics
from tracesynth.evaluate.classifier import ClassifierConfig, train_classifier
from tracesynth.evaluate.windows import Vocab, make_windows
from tracesynth.generators.markov import MarkovChain
from tracesynth.trace import Trace

REPO = Path(__file__).resolve().parents[1]


def timed(label: str, fn, n: int | None = None, unit: str = "events"):
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    rate = f", {n / dt:,.0f} {unit}/s" if n else ""
    print(f"{label:<40s} {dt:8.3f} s{rate}")
    return out


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "data" / "scimark2.parquet"
    if not path.exists():
        print(f"skip: {path} is absent")
        return
    torch.set_num_threads(1)
    trace = Trace.load(path)
    n = len(trace)
    print(f"{path.name}: {n:,} events")
    m = timed("markov order 4: fit", lambda: MarkovChain(4).fit([trace]), n)
    s = timed("markov order 4: sample 100k", lambda: m.sample(100_000, seed=0), 100_000)
    timed("fidelity (JSD 1-3, dt, latency)", lambda: metrics.fidelity(trace, s), n + len(s))
    timed("memorisation (longest run, copies)", lambda: metrics.memorisation(s, trace), n + len(s))
    v = Vocab.from_traces([trace])
    w = make_windows(trace.slice(0, 20_000), v, 128)
    cfg = ClassifierConfig(embed=32, hidden=32, steps=50, batch=64)
    train_classifier(w, w.labels, len(v), len(v), ClassifierConfig(steps=2))  # warm-up (first-call init)
    t = time.perf_counter()
    train_classifier(w, w.labels, len(v), len(v), cfg)
    print(f"{'classifier (GRU 32, L=128, batch 64)':<40s} {(time.perf_counter() - t) / cfg.steps * 1e3:8.1f} ms/step")
    codes = trace.codes("event")[0]
    cut = int(0.9 * n)
    share = metrics.copied_window_share(codes[cut:], codes[:cut])
    print(f"real: share of 128-event windows in the last 10% copied from the first 90%: {share:.3f}")


if __name__ == "__main__":
    main()
